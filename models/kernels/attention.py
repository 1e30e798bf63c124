"""Decode attention over whole tiles of a stage's KV cache (GPUs).

A length of pos+1 rows is a reduction axis tinygrad cannot split over threads (nothing divides it), so softmax
and the weighted sum ran on a few dozen threads; `tiles` x `tile` rows split (docs/BENCHMARKS.md). The rows past
the token's position are masked. Each request of a decode batch runs its own kernels: a batch read through one
concatenation of per-slot views was 2-11x slower on an H200 (a gated load per request at every element).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from models.kernels.matvec import gpu_reduce

if TYPE_CHECKING:
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
