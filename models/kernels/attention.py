"""Attention over whole tiles of a stage's KV cache, for a batch of requests in their own slots.

A length of pos+1 rows is a reduction axis tinygrad cannot split over threads (nothing divides it), so softmax
and the weighted sum ran on a few dozen threads; `tiles` x `tile` rows split (docs/BENCHMARKS.md). The rows past
each request's position are masked. Decode steps and prefill chunks (on GPUs) attend so.

A decode batch's requests sit in their own KV slots at their own positions. With `batched_attention_on()` the
whole batch runs as one set of kernels: each row reads its slot through a concatenation of per-slot views (a
gated load per request, one read of each row's cache) over the batch's longest cache, in tiles. Otherwise each
request runs its own kernels over its own length.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from models.kernels.matvec import gpu_reduce

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp


def batched_attention_on() -> bool:
    """`SWARMD_BATCHED_ATTENTION=0` gives each request of a decode batch its own attention kernels (for
    side-by-side measurements)."""
    return os.environ.get("SWARMD_BATCHED_ATTENTION", "1") != "0"


def tiled_attention(q: Tensor, cache: Tensor, slots: Sequence[UOp], starts: Sequence[UOp], tiles: UOp, *,
                    tile: int, positions: Tensor, n_kv_heads: int) -> Tensor:
    """q (B, heads, T, head_dim): T tokens of each of B requests over `cache` (2, slots, kv_heads, rows,
    head_dim). Token t of row b sits at position starts[b] + t and attends to rows [0, starts[b] + t] of slot
    slots[b] (its own row included: its K/V are stored first), read as `tiles` whole tiles of `tile` rows
    (enough for the longest). `positions` is arange over the cache's rows. Returns (B, heads, T, head_dim)."""
    from tinygrad import Tensor

    batch, n_heads, T, hd = q.shape
    kvh, group, rows = n_kv_heads, n_heads // n_kv_heads, tiles * tile
    shape = (1, kvh, group, T, tiles, tile)

    # each request's rows are read and broadcast over its query heads and tokens before the batch is put
    # together: an elementwise op (the concatenation) under a broadcast would be stored to a buffer first
    def per_slot(cache: Tensor, kind: int) -> Tensor:
        return Tensor.cat(*[cache[kind, s:s + 1, :, 0:rows, :].reshape(1, kvh, 1, 1, tiles, tile, hd)
                            .expand(*shape, hd) for s in slots])

    scores = (q.reshape(batch, kvh, group, T, 1, 1, hd) * per_slot(cache, 0)).sum(-1) * (1 / math.sqrt(hd))
    rows_at = positions[0:rows].reshape(1, 1, 1, 1, tiles, tile)
    last = positions[0:T].reshape(1, 1, 1, T, 1, 1) if T > 1 else 0  # each token's offset in its chunk
    visible = Tensor.cat(*[(rows_at <= last + p).expand(shape) for p in starts])
    scores = visible.where(scores, -math.inf).contiguous()
    weights = (scores - scores.max((-2, -1), keepdim=True)).exp()
    total = weights.sum((-2, -1))

    def weighted(w: Tensor, c: Tensor) -> Tensor:
        return (w.unsqueeze(-1) * per_slot(c, 1)).sum((-3, -2))

    if T == 1:  # few outputs: the sum over rows split over a thread group (it divides tiles x tile rows)
        # the values are read from the cache inside the weighted sum's kernel (not copied out of it first)
        out = gpu_reduce(weighted, (("GROUPTOP", 0, math.gcd(16, tile)),), weights, cache)
    else:
        out = weighted(weights, cache)
    return (out / total.unsqueeze(-1)).reshape(batch, n_heads, T, hd)


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
