"""`swarmd join --plan FILE`: the founding daemon's leader adopts a given Plan instead of computing one.

It waits, with progress in status, until every peer the plan names is a live member, then publishes
the plan under a fresh epoch. If a named peer goes later, the planner plans around it until the peer
is back, and the file's plan is adopted again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from planner import ModelLayout, Plan
from planner.errors import PlanSchemaError
from planner.plan import validate_chain
from swarmd.errors import UserError
from swarmd.identity import short_id
from swarmd.planning import MakePlan

log = logging.getLogger("swarmd.plan")


class PlanNotAdopted(Exception):
    """The file's plan cannot be adopted yet; the message says why (shown in status)."""


def load_plan_file(path: Path, layout: ModelLayout) -> Plan:
    """Read and check a Plan JSON file against the served model; UserError in one line if it does not fit."""
    try:
        plan = Plan.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--plan {path}: no such file") from None
    except PlanSchemaError as e:
        raise UserError(f"--plan {path}: {e}") from None
    if plan.model.name and plan.model.name != layout.name:
        raise UserError(f"--plan {path} is for model {plan.model.name!r}, this daemon serves {layout.name!r}")
    if plan.model.digest and layout.digest and plan.model.digest != layout.digest:
        raise UserError(f"--plan {path} is for other weights of {layout.name} (digest {plan.model.digest[:12]})")
    try:
        validate_chain(plan, layout.n_blocks)
    except PlanSchemaError as e:
        raise UserError(f"--plan {path}: {e}") from None
    return plan


class FixedPlan:
    def __init__(self, plan: Plan, layout: ModelLayout, source: str) -> None:
        self.plan = plan
        self.layout = layout
        self.source = source
        self.adopted = False

    def make(self, action: MakePlan, fallback: Callable[[MakePlan], Plan]) -> Plan:
        """The file's plan under `action.epoch` once its peers are live; else wait (or, after a first
        adoption, let the planner plan around the missing peers)."""
        live = {n.peer_id for n in action.nodes}
        named = self.plan.peers()
        missing = [p for p in named if p not in live]
        if not missing:
            problems = check_against(self.plan, self.layout, action)
            if problems:
                raise PlanNotAdopted(f"the plan in {self.source} does not fit the members: {'; '.join(problems)}")
            if not self.adopted:
                log.info("all %d peers named in %s have joined: adopting it", len(named), self.source)
            self.adopted = True
            return replace(self.plan, epoch=action.epoch)
        if self.adopted:
            log.warning("%s named in %s are gone: planning around them until they are back",
                        ", ".join(short_id(p) for p in missing), self.source)
            return fallback(action)
        raise PlanNotAdopted(f"waiting for {len(missing)} of {len(named)} peers named in {self.source} to join: "
                             + ", ".join(short_id(p) for p in missing))


def check_against(plan: Plan, layout: ModelLayout, action: MakePlan) -> list[str]:
    """The planner's own check where it has one; else the memory each stage needs against each node."""
    try:
        from planner import check_plan_against  # type: ignore[attr-defined]
    except ImportError:
        check_plan_against = None
    if check_plan_against is not None:
        return list(check_plan_against(plan, layout, list(action.nodes)))
    free = {n.peer_id: n.memory_free for n in action.nodes}
    problems = []
    for s in plan.stages:
        a, b = s.layers
        need = sum(layout.blocks[i].total_bytes for i in range(a, b))
        if need > free.get(s.peer_id, 0):
            problems.append(f"{short_id(s.peer_id)} has {free.get(s.peer_id, 0) / 2**30:.1f} GiB free, "
                            f"blocks {a}-{b - 1} need {need / 2**30:.1f} GiB")
    return problems
