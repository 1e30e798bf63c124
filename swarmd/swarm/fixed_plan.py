"""`swarmd join --plan FILE`: the founding daemon's leader adopts a given Plan instead of computing one.

It waits, with progress in status, until every peer the plan names is a live member, then publishes
the plan under a fresh epoch; members it does not name that joined as spares (`--standby`) get a copy
of a stage to hold (`planner.standby`), unless the file names its own standbys. If a named peer goes later, the planner plans around it until the peer
is back, and the file's plan is adopted again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from planner import ModelLayout, Plan, PlanOptions, check_plan_against
from planner.check import missing_peers
from planner.errors import PlanSchemaError
from planner.standby import choose_standbys
from swarmd.errors import UserError
from swarmd.net.identity import short_id
from swarmd.swarm.planning import MakePlan

log = logging.getLogger(__name__)


class PlanNotAdopted(Exception):
    """The file's plan cannot be adopted yet; the message says why (shown in status)."""


def load_plan_file(path: Path, layout: ModelLayout) -> Plan:
    """Read a Plan JSON file and check it against the served model; UserError in one line if it cannot fit."""
    try:
        plan = Plan.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--plan {path}: no such file") from None
    except PlanSchemaError as e:
        raise UserError(f"--plan {path}: {e}") from None
    problems = [p for p in check_plan_against(plan, layout, []) if not missing_peers([p])]
    if problems:
        raise UserError(f"--plan {path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return plan


class FixedPlan:
    def __init__(self, plan: Plan, layout: ModelLayout, source: str, options: PlanOptions | None = None) -> None:
        self.plan = plan
        self.options = options
        self.layout = layout
        self.source = source
        self.adopted = False

    def make(self, action: MakePlan, fallback: Callable[[MakePlan], Plan]) -> Plan:
        """The file's plan under `action.epoch` once it fits the live members; until then wait (or,
        after a first adoption, let the planner plan around the missing peers)."""
        problems = check_plan_against(self.plan, self.layout, list(action.nodes), self.options)
        if not problems:
            if not self.adopted:
                log.info("every peer named in %s has joined: adopting it", self.source)
            self.adopted = True
            return self._with_standbys(replace(self.plan, epoch=action.epoch), action)
        if not missing_peers(problems):
            raise PlanNotAdopted(f"the plan in {self.source} does not fit the members: {'; '.join(problems)}")
        live = {n.peer_id for n in action.nodes}
        named = self.plan.peers()
        missing = [p for p in named if p not in live]
        if self.adopted:
            log.warning("%s named in %s are gone: planning around them until they are back",
                        ", ".join(short_id(p) for p in missing), self.source)
            return fallback(action)
        raise PlanNotAdopted(f"waiting for {len(missing)} of {len(named)} peers named in {self.source} to join: "
                             + ", ".join(short_id(p) for p in missing))

    def _with_standbys(self, plan: Plan, action: MakePlan) -> Plan:
        if plan.standbys:
            return plan
        previous = action.previous.standbys if action.previous is not None else None
        standbys, reasons = choose_standbys(self.layout, action.nodes, [(s.peer_id, s.layers) for s in plan.stages],
                                            set(plan.peers()), self.options or PlanOptions(), previous)
        return replace(plan, standbys=standbys, reasons=(*plan.reasons, *reasons))
