"""What a plan costs in weights to move before it serves: bytes each node must fetch, and the time to ready.

A node fetches the parts of its assignment that its holdings (`planner.holdings`) lack: blocks, the embedding
on the first stage, the head on the last, routed experts. Bytes are the layout's, scaled to the model file's
(`ModelLayout.stored_bytes`: what a fetch really moves). A node fetches at most at its link's rate and the
swarm's per-source serving rate (`PlanOptions.fetch_bytes_per_s`); all fetchers together at most at what the
holders can serve. Loading what is assigned then takes `PlanOptions.load_bytes_per_s`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.holdings import Holdings
from planner.layout import ModelLayout
from planner.node import NodeDescriptor
from planner.options import PlanOptions


@dataclass(frozen=True)
class FetchEstimate:
    bytes_by_node: dict[int, int]  # node index -> bytes of the model file it must fetch
    fetch_s: float  # until the last fetch is done
    ready_s: float  # fetch, then load, on the slowest node

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_node.values())


def stored_fraction(layout: ModelLayout) -> float:
    """File bytes per layout byte (the file is quantised, the layout counts float16)."""
    total = layout.total_bytes
    return layout.stored_bytes / total if layout.stored_bytes and total else 1.0


def fetch_estimate(layout: ModelLayout, nodes: Sequence[NodeDescriptor], holdings: Sequence[Holdings],
                   stages: Sequence[tuple[int, int, int]], experts: Mapping[int, Sequence[Sequence[int]]],
                   opts: PlanOptions) -> FetchEstimate:
    """`stages`: (node, start, end); `experts`: block -> holders (node indices) of each expert."""
    assigned: dict[int, float] = {}
    missing: dict[int, float] = {}

    def add(node: int, size: float, held: bool) -> None:
        assigned[node] = assigned.get(node, 0.0) + size
        if not held:
            missing[node] = missing.get(node, 0.0) + size

    n_blocks = layout.n_blocks
    for node, a, b in stages:
        h = holdings[node]
        if a == 0:
            add(node, layout.embedding_bytes, h.everything or h.embedding)
        for blk in range(a, b):
            add(node, layout.blocks[blk].param_bytes, h.has_block(blk))
        if b == n_blocks:
            add(node, layout.head_bytes, h.everything or h.head)
    for blk, by_expert in experts.items():
        moe = layout.blocks[blk].moe
        size = moe.bytes_per_expert if moe else 0
        for e, holders in enumerate(by_expert):
            for node in holders:
                add(node, size, holdings[node].has_expert(blk, e))
    scale = stored_fraction(layout)
    by_node = {n: int(b * scale) for n, b in missing.items() if b > 0}
    sources = [i for i, h in enumerate(holdings) if h.anything]
    fetch_s = 0.0
    if by_node:
        per_node = max(size / _rate(nodes[n], opts) for n, size in by_node.items())
        serving = sum(_rate(nodes[i], opts) for i in sources) or _rate(nodes[0], opts)
        fetch_s = max(per_node, sum(by_node.values()) / serving)
    load_s = max((size * scale for size in assigned.values()), default=0.0) / opts.load_bytes_per_s
    return FetchEstimate(by_node, fetch_s, fetch_s + load_s)


def _rate(node: NodeDescriptor, opts: PlanOptions) -> float:
    return max(1.0, min(opts.fetch_bytes_per_s, node.uplink_bps / 8))
