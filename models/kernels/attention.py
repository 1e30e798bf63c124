"""Attention over whole tiles of a stage's KV cache, and a decode batch's KV write in one kernel.

A length of pos+1 rows is a reduction axis tinygrad cannot split over threads (nothing divides it), so softmax
and the weighted sum ran on a few dozen threads; `tiles` x `tile` rows split (docs/BENCHMARKS.md). The rows past
each token's position are masked. Decode steps and prefill chunks attend so on GPUs, each request on its own
kernels (a batch read through one concatenation of per-slot views was 2-11x slower on an H200: a gated load per
request at every element).

A decode batch's requests sit in their own KV slots at their own positions; a store per request is B kernels.
With `batched_kv_write_on()` one kernel writes them all, its slots and positions read from a small tensor.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from models.kernels.matvec import gpu_reduce

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp


def batched_kv_write_on() -> bool:
    """`SWARMD_BATCHED_KV_WRITE=0` gives each request of a decode batch its own KV store kernel (for side-by-side
    measurements)."""
    return os.environ.get("SWARMD_BATCHED_KV_WRITE", "1") != "0"


def tiled_attention(q: Tensor, cache: Tensor, slot: UOp, start: UOp, tiles: UOp, *, tile: int, positions: Tensor,
                    n_kv_heads: int) -> Tensor:
    """q (1, heads, T, head_dim): T tokens of one request over `cache` (2, slots, kv_heads, rows, head_dim).
    Token t sits at position start + t and attends to rows [0, start + t] of `slot` (its own row included: its
    K/V are stored first), read as `tiles` whole tiles of `tile` rows. `positions` is arange over the cache's
    rows. Returns (1, heads, T, head_dim)."""
    _, n_heads, T, hd = q.shape
    kvh, group, rows = n_kv_heads, n_heads // n_kv_heads, tiles * tile

    def rows_of(cache: Tensor, kind: int) -> Tensor:
        return cache[kind, slot:slot + 1, :, 0:rows, :].reshape(1, kvh, 1, 1, tiles, tile, hd)

    scores = (q.reshape(1, kvh, group, T, 1, 1, hd) * rows_of(cache, 0)).sum(-1) * (1 / math.sqrt(hd))
    rows_at = positions[0:rows].reshape(1, 1, 1, 1, tiles, tile)
    offset = positions[0:T].reshape(1, 1, 1, T, 1, 1) if T > 1 else 0  # each token's place in its chunk
    scores = (rows_at <= offset + start).where(scores, -math.inf).contiguous()
    weights = (scores - scores.max((-2, -1), keepdim=True)).exp()
    total = weights.sum((-2, -1))

    def weighted(w: Tensor, c: Tensor) -> Tensor:
        return (w.unsqueeze(-1) * rows_of(c, 1)).sum((-3, -2))

    if T == 1:  # few outputs: the sum over rows split over a thread group (it divides tiles x tile rows)
        out = gpu_reduce(weighted, (("GROUPTOP", 0, math.gcd(16, tile)),), weights, cache)
    else:
        out = weighted(weights, cache)
    return (out / total.unsqueeze(-1)).reshape(1, n_heads, T, hd)


def decode_rows_at(slots: Sequence[UOp], starts: Sequence[UOp], device: str) -> Tensor:
    """(B, 2) int32: each request's slot and position, for `store_decode_rows` (built once per step)."""
    from tinygrad import Tensor, dtypes

    return Tensor.stack(*[Tensor(v, device=device) for pair in zip(slots, starts, strict=True) for v in pair]) \
        .cast(dtypes.int32).reshape(len(slots), 2)


def store_decode_rows(kv: Tensor, rows: Tensor, at: Tensor) -> Tensor:
    """A decode batch's new keys and values, rows (B, 2, kv_heads, head_dim), written into `kv` (2, slots,
    kv_heads, rows, head_dim) at row at[b, 1] of slot at[b, 0] (`decode_rows_at`), by one kernel (a store per
    request would be B kernels). Returns `kv` after the write."""
    from tinygrad import dtypes
    from tinygrad.uop.ops import KernelInfo, UOp

    two, n_slots, kvh, n_rows, hd = kv.shape
    batch, width = rows.shape[0], two * kvh * hd

    def kernel(out: UOp, src: UOp, where: UOp) -> UOp:
        b, j = UOp.range(batch, 0), UOp.range(width, 1)
        slot, pos = (where.flatten()[b * 2 + k].cast(dtypes.weakint) for k in (0, 1))
        kind, head, d = j // (kvh * hd), j // hd % kvh, j % hd
        to = (((kind * n_slots + slot) * kvh + head) * n_rows + pos) * hd + d
        return out.flatten()[to].store(src.flatten()[b * width + j].cast(out.dtype.base)).end(b, j) \
            .sink(arg=KernelInfo(name="kv_rows"))

    return kv.custom_kernel(rows, at, fxn=kernel)[0]


def tiles_for(position: int, tile: int) -> int:
    """The whole tiles that hold rows [0, position]."""
    return position // tile + 1
