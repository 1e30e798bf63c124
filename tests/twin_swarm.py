"""Whole daemons in the test process for the fault, pipeline and MoE tests: `swarmd.testing.twin` on the
in-memory network, with the loaded stages shared by every test of the session (`TWIN_POOL`).

    twin, daemons = await twin_swarm(nursery, tmp_path, model, 3)   # founded, joined and ready
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from swarmd.testing.memory_network import MemoryHub
from swarmd.testing.twin import ModelPool, SwarmTwin, TwinDaemon

TWIN_POOL = ModelPool()  # one per test process: a block range's graphs are compiled once


async def twin_swarm(nursery: trio.Nursery, root: Path, model: str | Path, n: int, *, hub: MemoryHub | None = None,
                     stages: int | None = None, per_daemon: dict[int, dict[str, Any]] | None = None,
                     **settings: Any) -> tuple[SwarmTwin, list[TwinDaemon]]:
    """`n` daemons serving `model` (the first founds, the others join through it), once the chain is ready;
    each allowed the memory for about a `stages`-th of the model (default: `n` stages)."""
    hub = hub or await nursery.start(MemoryHub().run)
    twin = SwarmTwin(hub, root, str(model), pool=TWIN_POOL, **settings)
    if "memory_limit" not in settings:
        twin.settings["memory_limit"] = twin.memory_for_stages(stages or n)
    founder = await twin.start(nursery, 0, **(per_daemon or {}).get(0, {}))
    daemons = [founder]
    for i in range(1, n):
        daemons.append(await twin.start(nursery, i, via=founder, **(per_daemon or {}).get(i, {})))
    await twin.wait_ready(founder)
    return twin, daemons


def stage_daemons(twin: SwarmTwin, daemons: list[TwinDaemon]) -> list[TwinDaemon]:
    """The daemons holding the current plan's stages, in chain order."""
    plan = daemons[0].node.plan
    by_peer = {d.peer_id: d for d in daemons if d.alive}
    return [by_peer[s.peer_id] for s in plan.stages if s.peer_id in by_peer]
