"""A swarm of `SwarmService`s on one in-memory hub (no model, no libp2p), each killable on its own: for the
whole-swarm tests and `scripts/bench_gossip.py`."""

from __future__ import annotations

from dataclasses import replace

import trio

from planner import BUILTIN_ARCHS, layout_from_arch, make_plan
from swarmd.config import LAN
from swarmd.net.identity import Signer, peer_id_of
from swarmd.swarm.planning import MakePlan
from swarmd.swarm.service import SwarmService, SwarmSettings
from swarmd.testing.memory_network import MemoryHub
from swarmd.testing.twin import run_inline
from tests.swarm.swarm_helpers import descriptor, key

LAYOUT = layout_from_arch(BUILTIN_ARCHS["smollm2-135m"], "f16")


def planner(action: MakePlan):
    return make_plan(LAYOUT, action.nodes, epoch=action.epoch, previous=action.previous)


class Swarm:
    """Services on one hub; each runs in its own cancel scope so a test can kill it."""

    def __init__(self, nursery: trio.Nursery, hub: MemoryHub) -> None:
        self.nursery, self.hub = nursery, hub
        self.services: dict[str, SwarmService] = {}
        self.scopes: dict[str, trio.CancelScope] = {}

    async def start(self, n: int, *, bootstrap: str | None = None, incarnation: int = 1,
                    model: str = "smollm2-135m") -> SwarmService:
        kp = key(n)
        pid = peer_id_of(kp)
        net = self.hub.endpoint(pid)
        desc = replace(descriptor(pid, incarnation=incarnation, model=model), addresses=tuple(net.addresses()))
        boot = ((bootstrap, f"/memory/{bootstrap}"),) if bootstrap else ()
        # the planner inline: in a worker thread it would let the virtual clock jump while it runs
        svc = SwarmService(net, Signer(kp), SwarmSettings("test", LAN, boot), describe_self=lambda: desc,
                           make_plan=planner, blocking=run_inline)
        scope = trio.CancelScope()

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await svc.run(task_status=task_status)

        await self.nursery.start(run)
        self.services[pid], self.scopes[pid] = svc, scope
        return svc

    def kill(self, pid: str) -> None:
        self.hub.crash(pid)
        self.scopes.pop(pid).cancel()
        self.services.pop(pid)

    def views(self):
        return {(s.leader, s.term, s.coordinator.epoch, frozenset(s.membership.live())) for s in self.services.values()}
