"""This daemon's side of a plan file's slots (`swarmd join --plan FILE --slot NAME`).

The leader's `FixedPlan` binds the slots (`swarmd.swarm.slots`); this gossips the bindings in the leader's
heartbeat, keeps the ones a leader gossiped (a next leader starts from them), stops a daemon whose slot the leader
gave to another live member with a one-line error, and has the leader name the slots nobody claimed within the
claim timeout, in its status and once in its log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from planner import ModelLayout, PlanOptions
from planner.plan_file import PlanFile
from swarmd.config import DaemonConfig
from swarmd.errors import UserError
from swarmd.swarm.fixed_plan import FixedPlan, load_plan_file

log = logging.getLogger(__name__)


def fixed_plan(cfg: DaemonConfig, layout: ModelLayout, options: PlanOptions) -> FixedPlan:
    """The plan file of `swarmd join --plan FILE [--slot NAME]`, checked against the model and the slot."""
    assert cfg.plan is not None
    loaded = load_plan_file(Path(cfg.plan), layout, cfg.slot)
    plan = loaded.plan if isinstance(loaded, PlanFile) else loaded
    log.info("will run %sthe plan in %s (%d stages) once %s", f"slot {cfg.slot} of " if cfg.slot else "", cfg.plan,
             len(plan.stages), "every slot it uses is claimed" if isinstance(loaded, PlanFile) else
             "its peers have joined")
    return FixedPlan(loaded, layout, Path(cfg.plan).name, options, claim_timeout=cfg.claim_timeout)


class SlotClaim:
    def __init__(self, fixed: FixedPlan, slot: str, peer_id: str, *, leading: Callable[[], bool],
                 live: Callable[[], set[str]]) -> None:
        assert fixed.file is not None
        self.fixed, self.file = fixed, fixed.file
        self.slot, self.peer_id = slot, peer_id
        self.leading, self.live = leading, live

    def bindings(self) -> dict[str, str]:
        """What the leader gossips: slot -> peer id, as it bound them."""
        return dict(self.fixed.held)

    def on_slots(self, bindings: dict[str, str]) -> None:
        """The leader's bindings. A slot held by another live member is refused: UserError (the daemon stops)."""
        if self.leading():
            return
        self.fixed.learn(bindings)
        holder = bindings.get(self.slot)
        if self.slot and holder not in (None, self.peer_id) and holder in self.live():
            free = [s for s in self.file.fleet.names if s not in bindings]
            raise UserError(f"slot {self.slot} of {self.fixed.source} is held by {holder}: the leader refused this "
                            "daemon's claim; start it with another --slot"
                            + (f" (unclaimed: {', '.join(free)})" if free else ""))

    def plan_error(self, error: str | None, has_plan: bool) -> str | None:
        """The planner's last error, or, once the claim timeout has passed without a plan, the slots nobody claimed."""
        overdue = self.fixed.overdue() if self.leading() and not has_plan else []
        if overdue:
            return (f"slot(s) {', '.join(overdue)} of {self.fixed.source} not claimed within "
                    f"{self.fixed.claim_timeout:.0f} s: start `swarmd join --plan FILE --slot NAME` for each")
        return error

    def status(self) -> dict[str, Any]:
        return self.fixed.status(self.slot)

    async def watch(self) -> None:
        """As leader: say once in the log which slots nobody claimed within the claim timeout."""
        said: list[str] = []
        while True:
            await trio.sleep(1.0)
            overdue = self.fixed.overdue() if self.leading() else []
            if overdue and overdue != said:
                log.warning("no daemon has claimed slot(s) %s of %s within %.0f s", ", ".join(overdue),
                            self.fixed.source, self.fixed.claim_timeout)
            said = overdue
