"""Bytes a node needs for what a plan gives it: weights, KV budget, runtime overhead.

One accounting, used by the planner (feasibility), by `check_plan_against` (live members) and by
the `swarmd plan` table, so the three never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from planner.layout import ModelLayout
from planner.options import PlanOptions


def kv_bytes(layout: ModelLayout, opts: PlanOptions) -> np.ndarray:
    """KV budget per block: the configured context for every concurrent request."""
    per_token = np.array([b.kv_bytes_per_token for b in layout.blocks], dtype=np.float64)
    return per_token * opts.context_length * opts.concurrency


def dense_bytes(layout: ModelLayout, opts: PlanOptions) -> np.ndarray:
    """Per block: its weights except routed experts, plus its KV budget."""
    weights = np.array([b.param_bytes for b in layout.blocks], dtype=np.float64)
    return weights + kv_bytes(layout, opts)


def expert_bytes(layout: ModelLayout) -> np.ndarray:
    """Per block: the bytes of all its routed experts (0 for dense blocks)."""
    return np.array([b.moe.n_experts * b.moe.bytes_per_expert if b.moe else 0 for b in layout.blocks],
                    dtype=np.float64)


def ends_bytes(layout: ModelLayout, first: bool, last: bool) -> int:
    """Embedding on the first stage, output norm and head on the last (once when tied and both)."""
    if first and last and layout.tied_head:
        return max(layout.embedding_bytes, layout.head_bytes)
    return (layout.embedding_bytes if first else 0) + (layout.head_bytes if last else 0)


def stage_need_matrix(layout: ModelLayout, opts: PlanOptions, *, with_experts: bool = False) -> np.ndarray:
    """need[a, b] = bytes of a stage covering blocks [a, b) (inf where b <= a), overhead excluded."""
    per_block = dense_bytes(layout, opts) + (expert_bytes(layout) if with_experts else 0.0)
    prefix = np.concatenate([[0.0], np.cumsum(per_block)])
    need = prefix[None, :] - prefix[:, None]
    n = layout.n_blocks
    need[0, :] += layout.embedding_bytes
    need[:, n] += layout.head_bytes
    if layout.tied_head:
        need[0, n] -= min(layout.embedding_bytes, layout.head_bytes)
    need[np.tril_indices(n + 1)] = np.inf
    return need


def stage_bytes(layout: ModelLayout, a: int, b: int, opts: PlanOptions) -> int:
    """Bytes of a stage covering blocks [a, b): dense weights, KV budget, embedding/head; no overhead."""
    dense = dense_bytes(layout, opts)[a:b].sum()
    return int(dense) + ends_bytes(layout, a == 0, b == layout.n_blocks)


def node_memory_use(
    layout: ModelLayout,
    stages: Sequence[tuple[str, tuple[int, int]]],
    experts: Mapping[int, Mapping[int, Sequence[str]]],
    opts: PlanOptions,
) -> dict[str, int]:
    """peer id -> bytes it needs for its stage(s) and expert copies, runtime overhead included."""
    use: dict[str, int] = {}
    for peer, (a, b) in stages:
        use[peer] = use.get(peer, 0) + stage_bytes(layout, a, b, opts)
    for block, by_expert in experts.items():
        moe = layout.blocks[block].moe if 0 <= block < layout.n_blocks else None
        size = moe.bytes_per_expert if moe else 0
        for peers in by_expert.values():
            for peer in peers:
                use[peer] = use.get(peer, 0) + size
    return {peer: n + opts.runtime_overhead_bytes for peer, n in use.items()}


def kv_slots(layout: ModelLayout, a: int, b: int, opts: PlanOptions, memory_bytes: int, *, most: int,
             kv_scale: float = 1.0, extra_bytes: int = 0) -> int:
    """How many requests a stage of blocks [a, b) can hold at once: the KV caches of `opts.context_length`
    tokens that fit in `memory_bytes` beside its weights, `extra_bytes` (experts it holds) and the runtime
    overhead, one kept spare (a decode batch's padding rows); at least 1 (a plan budgets for
    `opts.concurrency`), at most `most`. `kv_scale`: bytes the stage's cache takes per KV byte of the layout
    (2 for a float32 cache where the layout counts 16-bit values)."""
    per_request = float(sum(blk.kv_bytes_per_token for blk in layout.blocks[a:b])) * opts.context_length * kv_scale
    if per_request <= 0:
        return most
    weights = stage_bytes(layout, a, b, opts) - float(kv_bytes(layout, opts)[a:b].sum())
    room = memory_bytes - weights - extra_bytes - opts.runtime_overhead_bytes
    return int(max(1, min(most, room // per_request - 1)))
