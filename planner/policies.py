"""make_plan: the one entry point the leader and `swarmd plan` call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.errors import InfeasiblePlan
from planner.layout import ModelLayout
from planner.node import NodeDescriptor
from planner.plan import ModelRef, Plan, Prediction, Stage, router_actor, stage_actor

GiB = 1024**3


@dataclass(frozen=True)
class PlanOptions:
    context_length: int = 2048  # KV budget per request
    concurrency: int = 4  # requests whose KV must fit at once
    runtime_overhead_bytes: int = 256 * 1024**2  # per node: runtime, kernels, buffers


def _stage_bytes(layout: ModelLayout, a: int, b: int, opts: PlanOptions) -> int:
    kv = sum(layout.blocks[i].kv_bytes_per_token for i in range(a, b)) * opts.context_length * opts.concurrency
    weights = sum(layout.blocks[i].param_bytes for i in range(a, b))
    extra = (layout.embedding_bytes if a == 0 else 0) + (layout.head_bytes if b == layout.n_blocks else 0)
    return weights + kv + extra + opts.runtime_overhead_bytes


def make_plan(
    layout: ModelLayout,
    nodes: Sequence[NodeDescriptor],
    *,
    policy: str = "balanced",
    epoch: int = 0,
    options: PlanOptions | None = None,
    previous: Plan | None = None,
) -> Plan:
    """Assign every block to a stage and every expert to a node. Deterministic in the set of nodes."""
    opts = options or PlanOptions()
    if not nodes:
        raise InfeasiblePlan("no nodes to plan over")
    ordered = sorted(nodes, key=lambda n: n.peer_id)
    n_blocks = layout.n_blocks
    usable = ordered[: max(1, min(len(ordered), n_blocks))]
    total_flops = sum(n.flops for n in usable)
    # Layers in proportion to speed, then clipped so the chain covers every block.
    stages: list[Stage] = []
    start = 0
    for i, node in enumerate(usable):
        remaining_nodes = len(usable) - i - 1
        share = round(n_blocks * node.flops / total_flops)
        end = n_blocks if remaining_nodes == 0 else min(max(start + 1, start + share), n_blocks - remaining_nodes)
        need = _stage_bytes(layout, start, end, opts)
        if need > node.memory_free:
            raise InfeasiblePlan(
                f"needs {(need - node.memory_free) / GiB:.1f} GiB more memory for blocks {start}-{end - 1}"
                f" on {node.peer_id}"
            )
        actors = (stage_actor(i), *(router_actor(b) for b in range(start, end) if layout.blocks[b].moe))
        stages.append(Stage(node.peer_id, (start, end), actors))
        start = end
    experts: dict[int, dict[int, tuple[str, ...]]] = {}
    for b in layout.moe_blocks():
        moe = layout.blocks[b].moe
        assert moe is not None
        experts[b] = {e: (ordered[e % len(ordered)].peer_id,) for e in range(moe.n_experts)}
    ms = sum(
        sum(layout.blocks[i].flops_per_token for i in range(s.layers[0], s.layers[1]))
        / next(n.flops for n in usable if n.peer_id == s.peer_id)
        for s in stages
    ) * 1e3
    return Plan(
        epoch=epoch,
        model=ModelRef(layout.name, layout.digest, layout.dtype),
        stages=tuple(stages),
        experts=experts,
        predicted=Prediction(ms, 1e3 / ms if ms else 0.0, 1e3 / ms if ms else 0.0, "compute"),
        reasons=tuple(f"{s.peer_id} runs blocks {s.layers[0]}-{s.layers[1] - 1}" for s in stages),
        policy=policy,
    )
