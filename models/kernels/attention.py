"""Decode attention over whole tiles of a stage's KV cache (GPUs).

A length of pos+1 rows is a reduction axis tinygrad cannot split over threads (nothing divides it), so softmax
and the weighted sum ran on a few dozen threads; `tiles` x `tile` rows split (docs/BENCHMARKS.md). The rows past
the token's position are masked. A lone request runs its own kernels (`tiled_decode_attention`); a decode batch
runs one set for all its rows (`batched_decode_attention`), each row's slot picked out of the cache by a
one-hot sum that tinygrad turns into a gather (a concatenation of per-slot views instead was 2-11x slower on an
H200: a gated load per request at every element).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from models.kernels.matvec import gpu_reduce

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp


def tiled_decode_attention(q: Tensor, cache: Tensor, slot: UOp, pos: UOp, tiles: UOp, *, tile: int,
                           positions: Tensor, n_kv_heads: int) -> Tensor:
    """One decoded token, q (1, heads, 1, head_dim), at position `pos` over `cache` (2, slots, kv_heads, rows,
    head_dim): rows [0, pos] of `slot` (its own row included: its K/V are stored first), read as `tiles` whole
    tiles of `tile` rows. `positions` is arange over the cache's rows. Returns (1, heads, 1, head_dim)."""
    _, n_heads, _, hd = q.shape
    kvh, group, rows = n_kv_heads, n_heads // n_kv_heads, tiles * tile

    def rows_of(kv: Tensor, kind: int) -> Tensor:
        return kv[kind, slot:slot + 1, :, 0:rows, :].reshape(1, kvh, 1, tiles, tile, hd)

    scores = (q.reshape(1, kvh, group, 1, 1, hd) * rows_of(cache, 0)).sum(-1) * (1 / math.sqrt(hd))
    scores = (positions[0:rows].reshape(tiles, tile) <= pos).where(scores, -math.inf).contiguous()
    weights = (scores - scores.max((-2, -1), keepdim=True)).exp()
    total = weights.sum((-2, -1))
    # few outputs: the sum over rows split over a thread group (it divides tiles x tile rows whatever the count);
    # it takes the whole cache and reads the request's values inside its kernel (a view would be copied first)
    out = gpu_reduce(lambda w, kv: (w.unsqueeze(-1) * rows_of(kv, 1)).sum((-3, -2)),
                     (("GROUPTOP", 0, math.gcd(16, tile)),), weights, cache)
    return (out / total.unsqueeze(-1)).reshape(1, n_heads, 1, hd)


def batch_rows_at(slots: Sequence[UOp], starts: Sequence[UOp], device: str) -> tuple[Tensor, Tensor]:
    """Each batch row's slot and position as (B, 1) int32 tensors, for `batched_decode_attention`."""
    from tinygrad import Tensor, dtypes

    def column(values: Sequence[UOp]) -> Tensor:
        return Tensor.stack(*[Tensor(v, device=device) for v in values]).cast(dtypes.int32).reshape(len(values), 1)

    return column(slots), column(starts)


def batched_decode_attention(q: Tensor, cache: Tensor, slots: Tensor, starts: Tensor, tiles: UOp, *, tile: int,
                             positions: Tensor, n_kv_heads: int) -> Tensor:
    """A decode batch, q (B, heads, 1, head_dim): row b at position starts[b] over rows [0, starts[b]] of slot
    slots[b] (`batch_rows_at`) of `cache` (2, slots, kv_heads, rows, head_dim), read as `tiles` whole tiles of
    `tile` rows (enough for the batch's longest). Rows may share a slot (a verify item's tokens). Returns
    (B, heads, 1, head_dim)."""
    batch, n_heads, _, hd = q.shape
    kvh, group, rows, n_slots = n_kv_heads, n_heads // n_kv_heads, tiles * tile, cache.shape[1]
    pick = (positions[0:n_slots].reshape(1, n_slots) == slots).reshape(batch, n_slots, 1, 1, 1)

    def rows_of(kind: int) -> Tensor:  # (B, kv_heads, 1, rows, head_dim): each row's own slot
        kv = cache[kind, :, :, 0:rows, :].reshape(1, n_slots, kvh, rows, hd)
        return pick.where(kv, 0).sum(1, dtype=cache.dtype).reshape(batch, kvh, 1, rows, hd)

    scores = (q.reshape(batch, kvh, group, 1, hd) * rows_of(0)).sum(-1) * (1 / math.sqrt(hd))
    visible = positions[0:rows].reshape(1, 1, 1, rows) <= starts.reshape(batch, 1, 1, 1)
    scores = visible.where(scores, -math.inf)
    weights = (scores - scores.max(-1, keepdim=True)).exp()
    out = (weights.unsqueeze(-1) * rows_of(1)).sum(-2) / weights.sum(-1).unsqueeze(-1)
    return out.reshape(batch, n_heads, 1, hd)
