"""A Plan read back against its layout and nodes: per-node roles, memory and predicted times.

For the `swarmd plan` table and for comparing a plan's prediction with the simulator's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import CostModel, Draft, Evaluation
from planner.errors import PlanSchemaError
from planner.layout import ModelLayout
from planner.memory import node_memory_use
from planner.node import NodeDescriptor
from planner.options import PlanOptions
from planner.plan import Plan
from planner.policies import sorted_nodes
from planner.topology import build_topology


@dataclass(frozen=True)
class NodeRow:
    role: str  # "stage-3", "experts", "standby" (a spare holding a copy of `blocks`) or "idle"
    peer_id: str
    label: str
    blocks: tuple[int, int] | None
    experts: int  # expert copies held
    expert_blocks: tuple[int, ...]
    memory_used: int
    memory_free: int
    ms_per_token: float | None  # the stage's share of the token latency (stages only)


def evaluate_plan(plan: Plan, layout: ModelLayout, nodes: Sequence[NodeDescriptor],
                  options: PlanOptions | None = None) -> tuple[Evaluation, CostModel]:
    """The cost model's evaluation of `plan` over `nodes` (every peer it names must be there)."""
    opts = options or PlanOptions()
    ordered = sorted_nodes(nodes)
    index = {n.peer_id: i for i, n in enumerate(ordered)}
    missing = [p for p in plan.peers() if p not in index]
    if missing:
        raise PlanSchemaError(f"the plan names peers that are not among the nodes: {', '.join(missing[:5])}")
    topo = build_topology(ordered, default_rtt_ms=opts.default_rtt_ms, group_rtt_ms=opts.group_rtt_ms)
    cm = CostModel(layout, ordered, opts, topo)
    draft = Draft(
        stages=[(index[s.peer_id], s.layers[0], s.layers[1]) for s in plan.stages],
        experts={b: [tuple(index[p] for p in by[x]) for x in sorted(by)] for b, by in plan.experts.items()},
    )
    return cm.evaluate(draft), cm


def node_rows(plan: Plan, layout: ModelLayout, nodes: Sequence[NodeDescriptor],
              options: PlanOptions | None = None) -> list[NodeRow]:
    """Stages in chain order, then nodes that hold only experts, then spares and idle nodes."""
    opts = options or PlanOptions()
    ev, _ = evaluate_plan(plan, layout, nodes, opts)
    by_peer = {n.peer_id: n for n in nodes}
    use = node_memory_use(layout, [(s.peer_id, s.layers) for s in plan.stages], plan.experts, opts)
    held: dict[str, int] = {}
    blocks_of: dict[str, set[int]] = {}
    for b, by in plan.experts.items():
        for peers in by.values():
            for p in peers:
                held[p] = held.get(p, 0) + 1
                blocks_of.setdefault(p, set()).add(b)
    rows = []
    for i, (s, ms) in enumerate(zip(plan.stages, ev.stage_ms, strict=True)):
        n = by_peer[s.peer_id]
        rows.append(NodeRow(f"stage-{i}", s.peer_id, n.label, s.layers, held.get(s.peer_id, 0),
                            tuple(sorted(blocks_of.get(s.peer_id, ()))), use.get(s.peer_id, 0), n.memory_free, ms))
    staged = {s.peer_id for s in plan.stages}
    for peer in sorted(held):
        if peer not in staged:
            n = by_peer[peer]
            rows.append(NodeRow("experts", peer, n.label, None, held[peer], tuple(sorted(blocks_of[peer])),
                                use.get(peer, 0), n.memory_free, None))
    copies = node_memory_use(layout, list(plan.standbys.items()), {}, opts)
    for n in sorted(nodes, key=lambda n: n.peer_id):
        if n.peer_id not in staged and n.peer_id not in held:
            copy = plan.standbys.get(n.peer_id)
            rows.append(NodeRow("standby" if copy else "idle", n.peer_id, n.label, copy, 0, (),
                                copies.get(n.peer_id, 0), n.memory_free, None))
    return rows
