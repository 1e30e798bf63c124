"""`swarmd join --plan FILE`: the leader adopts a given Plan instead of computing one.

It waits, with progress in status, until every peer the plan names is a live member, then publishes
the plan under a fresh epoch; members it does not name that joined as spares (`--standby`) get a copy
of a stage to hold (`planner.standby`), unless the file names its own standbys. If a named peer goes later, the planner plans around it until the peer
is back, and the file's plan is adopted again.

A plan file with a fleet (`swarmd plan --fleet ... --out FILE`) names slots instead of peers: every daemon is
started with `--plan FILE --slot NAME`, the leader binds each slot to the daemon claiming it
(`swarmd.swarm.slots`) and adopts the plan with their peer ids once every slot the plan uses is bound. Slots
still unclaimed after `claim_timeout` are named in the leader's status.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from planner import ModelLayout, Plan, PlanOptions, check_plan_against
from planner.check import missing_peers
from planner.errors import PlanSchemaError
from planner.plan_file import PlanFile
from planner.standby import choose_standbys
from swarmd.errors import UserError
from swarmd.net.identity import short_id
from swarmd.swarm.planning import MakePlan
from swarmd.swarm.slots import Binding, bind_slots

log = logging.getLogger(__name__)


class PlanNotAdopted(Exception):
    """The file's plan cannot be adopted yet; the message says why (shown in status)."""


def load_plan_file(path: Path, layout: ModelLayout, slot: str = "") -> Plan | PlanFile:
    """Read a Plan JSON file (a PlanFile when it has a fleet) and check it against the served model, and `slot`
    against its slots; UserError in one line if it cannot fit."""
    try:
        doc = json.loads(Path(path).read_text())
        loaded: Plan | PlanFile = PlanFile.from_json(doc) if isinstance(doc, dict) and "fleet" in doc \
            else Plan.from_json(doc)
    except FileNotFoundError:
        raise UserError(f"--plan {path}: no such file") from None
    except OSError as e:
        raise UserError(f"--plan {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--plan {path}: a Plan must be JSON: {e}") from None
    except PlanSchemaError as e:
        raise UserError(f"--plan {path}: {e}") from None
    plan = loaded.plan if isinstance(loaded, PlanFile) else loaded
    problems = [p for p in check_plan_against(plan, layout, []) if not missing_peers([p])]
    if problems:
        raise UserError(f"--plan {path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    if isinstance(loaded, PlanFile):
        if slot and slot not in loaded.fleet.names:
            raise UserError(f"--slot {slot}: {Path(path).name} has no such slot; its slots are "
                            f"{', '.join(loaded.fleet.names)}")
    elif slot:
        raise UserError(f"--slot needs a plan file with a fleet, which {Path(path).name} has not (write one with "
                        "`swarmd plan --fleet SPEC --out FILE`)")
    return loaded


class FixedPlan:
    def __init__(self, plan: Plan | PlanFile, layout: ModelLayout, source: str, options: PlanOptions | None = None,
                 *, claim_timeout: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.file = plan if isinstance(plan, PlanFile) else None
        self.plan: Plan | None = plan if isinstance(plan, Plan) else None  # with peer ids: bound once slots are
        self.options = options
        self.layout = layout
        self.source = source
        self.adopted = False
        self.claim_timeout = claim_timeout
        self.clock = clock
        self.held: dict[str, str] = {}  # slot -> peer id: this leader's bindings, or the last leader's gossiped
        self.binding = Binding()
        self.waiting_since: float | None = None  # when this node first planned with the slots

    def make(self, action: MakePlan, fallback: Callable[[MakePlan], Plan]) -> Plan:
        """The file's plan under `action.epoch` once it fits the live members; until then wait (or,
        after a first adoption, let the planner plan around the missing peers)."""
        if self.file is not None:
            plan = self._bind(action)
            if plan is None:
                return fallback(action)
            self.plan = plan
        assert self.plan is not None
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

    def _bind(self, action: MakePlan) -> Plan | None:
        """The file's plan with the slots bound to the live members claiming them; None to plan around slots whose
        daemon is gone after an adoption; PlanNotAdopted while slots the plan uses are unclaimed."""
        assert self.file is not None
        if self.waiting_since is None:
            self.waiting_since = self.clock()
        b = bind_slots(self.file.fleet.names, action.nodes, self.held)
        for peer, slot in b.refused.items():
            if self.binding.refused.get(peer) != slot:
                log.warning("refused %s's claim of slot %s: %s holds it", short_id(peer), slot,
                            short_id(b.peers[slot]))
        for peer, slot in b.unknown.items():
            if self.binding.unknown.get(peer) != slot:
                log.warning("%s claims slot %r, which %s does not have", short_id(peer), slot, self.source)
        self.binding, self.held = b, dict(b.peers)
        used = self.file.plan.peers()
        needed = [s for s in used if s not in b.peers]
        if not needed:
            return self.file.bind(b.peers)
        if self.adopted or action.previous is not None:  # the swarm has run: a new leader keeps it running
            log.warning("slots %s of %s have no live daemon: planning around them until they are claimed again",
                        ", ".join(needed), self.source)
            return None
        raise PlanNotAdopted(f"waiting for {len(needed)} of {len(used)} slots of {self.source} to be claimed: "
                             + ", ".join(needed))

    def learn(self, bindings: dict[str, str]) -> None:
        """The bindings the leader gossiped: where this node starts from if it comes to lead."""
        if self.file is not None:
            names = set(self.file.fleet.names)
            self.held = {s: p for s, p in bindings.items() if s in names}

    def overdue(self) -> list[str]:
        """Slots still unclaimed `claim_timeout` after this node began binding them (as the leader)."""
        if self.file is None or self.waiting_since is None or self.clock() - self.waiting_since < self.claim_timeout:
            return []
        return [s for s in self.file.fleet.names if s not in self.held]

    def status(self, slot: str) -> dict[str, Any]:
        """The `slots` part of `swarmd status`: this daemon's claim and the bindings as this node knows them."""
        assert self.file is not None
        names = self.file.fleet.names
        waited = None if self.waiting_since is None else round(self.clock() - self.waiting_since, 1)
        return {"file": self.source, "slot": slot, "bound": {s: self.held.get(s) for s in names},
                "unclaimed": [s for s in names if s not in self.held],
                "refused": dict(self.binding.refused), "claim_timeout_s": self.claim_timeout,
                "waiting_s": waited, "overdue": self.overdue()}

    def _with_standbys(self, plan: Plan, action: MakePlan) -> Plan:
        if plan.standbys:
            return plan
        previous = action.previous.standbys if action.previous is not None else None
        standbys, reasons = choose_standbys(self.layout, action.nodes, [(s.peer_id, s.layers) for s in plan.stages],
                                            set(plan.peers()), self.options or PlanOptions(), previous)
        return replace(plan, standbys=standbys, reasons=(*plan.reasons, *reasons))
