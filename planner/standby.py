"""Standby copies: which stage each spare node (`NodeDescriptor.standby`) holds a warm copy of.

A spare runs no stage while the other nodes can hold the model. It loads and warms one stage's blocks
instead, so that when that stage's node is lost the repaired plan puts the spare exactly in its place
(`planner.sticky`) and nothing has to load. The choice, per spare in peer-id order:

1. the copy it held in the previous plan, if that range is still a stage's and still fits (no load);
2. else the stage with the fewest standby copies so far, the largest first (the longest to load
   again), that fits its memory; ties by chain order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from planner.layout import ModelLayout
from planner.memory import stage_need_matrix
from planner.node import NodeDescriptor
from planner.options import PlanOptions

Range = tuple[int, int]


def spare_capacity(node: NodeDescriptor, held: int, opts: PlanOptions) -> int:
    """Bytes a spare can give its copy: its free memory plus the copy it holds now, overhead taken off."""
    total = node.memory_total or node.memory_free
    return max(0, min(total, node.memory_free + held) - opts.runtime_overhead_bytes)


def choose_standbys(layout: ModelLayout, nodes: Sequence[NodeDescriptor], stages: Sequence[tuple[str, Range]],
                    busy: set[str], opts: PlanOptions,
                    previous: dict[str, Range] | None = None) -> tuple[dict[str, Range], list[str]]:
    """{spare peer: the stage range it holds a copy of} and one reason line per spare.

    `stages` are (peer, [start, end)) in chain order; `busy` the peers with any assignment (never spares);
    `previous` the copies of the plan in force."""
    previous = previous or {}
    need = stage_need_matrix(layout, opts)
    ranges = [layers for _, layers in stages]
    index = {layers: i for i, layers in enumerate(ranges)}
    copies: Counter[Range] = Counter()
    out: dict[str, Range] = {}
    reasons: list[str] = []
    for node in sorted(nodes, key=lambda n: n.peer_id):
        if not node.standby or node.peer_id in busy:
            continue
        held = previous.get(node.peer_id)
        held_bytes = int(need[held]) if held is not None else 0
        room = spare_capacity(node, held_bytes, opts)
        if held is not None and held in index and need[held] <= room:
            choice, why = held, "keeps its copy"
        else:
            fits = [r for r in ranges if need[r] <= room]
            if not fits:
                reasons.append(f"standby {node.peer_id} holds no copy: no stage's blocks fit its memory")
                continue
            choice = min(fits, key=lambda r: (copies[r], -need[r], index[r]))
            why = "copies"
        copies[choice] += 1
        out[node.peer_id] = choice
        reasons.append(f"standby {node.peer_id} {why} blocks {choice[0]}-{choice[1] - 1} (stage {index[choice]}): "
                       "it takes that stage over without loading if its node is lost")
    return out, reasons
