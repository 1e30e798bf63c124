"""Decode attention over whole tiles of a stage's KV cache (GPUs).

A length of pos+1 rows is a reduction axis tinygrad cannot split over threads (nothing divides it), so softmax
and the weighted sum ran on a few dozen threads; `tiles` x `tile` rows split (docs/BENCHMARKS.md). The rows past
the token's position are masked. A lone request, or a batch whose rows share a slot (a verify step's), runs a set
of kernels per row (`tiled_decode_attention`; `tiled_latent_attention` for multi-head latent attention, every
batch). A batch of rows in distinct slots runs one set for the batch (`slot_ordered_decode_attention`): its
queries are put in slot order, and the cache's first slots attend as they lie, a plain slice with no load whose
address comes from memory (a concatenation of per-slot views, and a one-hot gather of each row's cache, were
slower on an H200: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from models.kernels.matvec import GPU_DEVICES, gpu_reduce

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

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

    visible = positions[0:rows].reshape(tiles, tile) <= pos
    return _over_tiles(q.reshape(1, kvh, group, 1, 1, hd), cache, rows_of, visible, tile).reshape(1, n_heads, 1, hd)


def tiled_latent_attention(q: Tensor, cache: Tensor, slot: UOp, pos: UOp, tiles: UOp, *, tile: int,
                           positions: Tensor, values: int, scale: float) -> Tensor:
    """Multi-head latent attention of one decoded token, its queries absorbed into the latent space: q (1, heads,
    1, latent) at position `pos` over rows [0, pos] of `slot` in `cache` (slots, rows, latent), whose rows are
    every head's keys and whose first `values` columns are their values, read as `tiles` whole tiles of `tile`
    rows; scores scaled by `scale`. Returns (1, heads, 1, values)."""
    _, n_heads, _, width = q.shape
    rows = tiles * tile

    def rows_of(kv: Tensor, kind: int) -> Tensor:
        part = kv[slot:slot + 1, 0:rows, :] if kind == 0 else kv[slot:slot + 1, 0:rows, 0:values]
        return part.reshape(1, 1, 1, tiles, tile, part.shape[-1])

    visible = positions[0:rows].reshape(tiles, tile) <= pos
    opts = latent_opts((n_heads, width, values, tile, cache.dtype.name))
    out = _over_tiles(q.reshape(1, 1, n_heads, 1, 1, width), cache, rows_of, visible, tile, opts, scale=scale)
    return out.reshape(1, n_heads, 1, values)


def _over_tiles(q: Tensor, cache: Tensor, rows_of: Callable[[Tensor, int], Tensor], visible: Tensor,
                tile: int, opts: dict[str, tuple | None] | None = None, scale: float | None = None) -> Tensor:
    """Queries q (n, kv_heads, group, 1, 1, head_dim) over the rows `rows_of(kv, kind)` reads from a cache `kv`
    ((n, kv_heads, 1, tiles, tile, head_dim); kind 0 the keys, 1 the values), where `visible` (broadcast to n,
    kv_heads, group, tiles, tile) holds; scores scaled by `scale` (default 1/sqrt(head_dim)). `opts` pins the
    kernels' options on GPUs ("scores", "sum"; None: tinygrad chooses). Returns (n, kv_heads, group, values'
    width)."""
    opts = {"scores": None, "sum": (("GROUPTOP", 0, math.gcd(16, tile)),)} if opts is None else opts
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale

    def masked_scores(q: Tensor, kv: Tensor, visible: Tensor) -> Tensor:
        return visible.where((q * rows_of(kv, 0)).sum(-1) * scale, -math.inf)

    pinned = opts.get("scores") if cache.device.split(":")[0] in GPU_DEVICES else None
    if pinned:  # options hold on a kernel function's output only: a plain contiguous's are lost
        scores = gpu_reduce(masked_scores, pinned, q, cache, visible)
    else:
        scores = masked_scores(q, cache, visible).contiguous()
    weights = (scores - scores.max((-2, -1), keepdim=True)).exp()
    total = weights.sum((-2, -1))

    def weighted(w: Tensor, kv: Tensor) -> Tensor:
        return (w.unsqueeze(-1) * rows_of(kv, 1)).sum((-3, -2))

    # few outputs: the sum over rows split over a thread group (it divides tiles x tile rows whatever the count);
    # it takes the whole cache and reads the values inside its kernel (a view would be copied first)
    out = gpu_reduce(weighted, opts["sum"], weights, cache) if opts.get("sum") else weighted(weights, cache)
    return out / total.unsqueeze(-1)


# The slot-ordered attention's kernel options on GPUs ("scores", "sum"; None: tinygrad's heuristics), found by
# tinygrad's BEAM search on an H200 (scripts/bench_decode_attention.py; docs/BENCHMARKS.md), keyed by the
# kernels' shape: (span, kv_heads, group, head_dim, tile, the cache's dtype). Options name axes of one shape, so
# a shape not here keeps `_over_tiles`' own.
SLOT_ORDERED_OPTS: dict[tuple[int, int, int, int, int, str], dict[str, tuple | None]] = {
    (8, 8, 4, 128, 128, "float"): {
        "scores": (("LOCAL", 3, 16), ("UNROLL", 0, 4), ("UPCAST", 2, 0), ("UPCAST", 2, 4), ("SWAP", 0, 1),
                   ("UNROLL", 0, 4)),
        "sum": (("LOCAL", 2, 16), ("GROUP", 0, 16), ("UPCAST", 2, 4), ("LOCAL", 1, 4), ("UPCAST", 4, 2),
                ("SWAP", 0, 1))},
    (32, 8, 4, 128, 128, "float"): {
        "scores": (("LOCAL", 3, 16), ("UNROLL", 0, 4), ("UNROLL", 0, 0), ("LOCAL", 1, 4), ("LOCAL", 3, 4),
                   ("SWAP", 2, 3), ("UPCAST", 3, 2), ("SWAP", 0, 2)),
        "sum": (("LOCAL", 2, 16), ("GROUP", 0, 8), ("UPCAST", 2, 4), ("UPCAST", 1, 2), ("SWAP", 1, 2),
                ("LOCAL", 0, 8), ("SWAP", 0, 1))},
}


def slot_ordered_opts(shape: tuple[int, int, int, int, int, str]) -> dict[str, tuple | None] | None:
    """The slot-ordered attention's kernel options for `shape` (a `SLOT_ORDERED_OPTS` key; None: not there).
    `SWARMD_ATTENTION_OPTS` (a JSON file of one entry, {"scores": ..., "sum": ...}, for searches and comparisons;
    a kernel missing or null there is left to tinygrad) overrides the table for every shape."""
    return _given_opts() or SLOT_ORDERED_OPTS.get(shape)


# The latent attention's kernel options on GPUs, found as `SLOT_ORDERED_OPTS`' were (`--latent`), keyed by (heads,
# latent width, values' width, tile, the cache's dtype); a shape not here keeps `_over_tiles`' own.
LATENT_OPTS: dict[tuple[int, int, int, int, str], dict[str, tuple | None]] = {
    (64, 576, 512, 128, "float"): {  # Kimi-K2, DeepSeek-V3
        "scores": (("GROUP", 0, 16), ("LOCAL", 0, 8), ("UPCAST", 1, 2), ("UPCAST", 0, 4)),
        "sum": (("LOCAL", 1, 16), ("GROUPTOP", 0, 16), ("UPCAST", 2, 4), ("LOCAL", 0, 8), ("UPCAST", 1, 2),
                ("SWAP", 0, 1))},
}


def latent_opts(shape: tuple[int, int, int, int, str]) -> dict[str, tuple | None] | None:
    """The latent attention's kernel options for `shape` (a `LATENT_OPTS` key; None: not there), overridden as
    `slot_ordered_opts`' are."""
    return _given_opts() or LATENT_OPTS.get(shape)


def _given_opts() -> dict[str, tuple | None] | None:
    """The options in the file `SWARMD_ATTENTION_OPTS` names, if any."""
    import json
    from pathlib import Path

    path = os.environ.get("SWARMD_ATTENTION_OPTS")
    if not path:
        return None
    table = json.loads(Path(path).read_text())
    return {k: tuple(tuple(o) for o in table[k]) if table.get(k) else None for k in ("scores", "sum")}


def slot_ordered() -> bool:
    """Whether batches in distinct slots attend in slot order (`SWARMD_SLOT_ORDERED_ATTENTION=0`: a set of kernels
    per row, for comparisons); read as the graphs are built."""
    return os.environ.get("SWARMD_SLOT_ORDERED_ATTENTION", "1") != "0"


def slot_span(slots: Sequence[int], n_slots: int) -> int:
    """The slots [0, span) a batch in distinct `slots` attends over: a power of two (few graphs), at most n_slots."""
    return min(1 << max(slots).bit_length(), n_slots)


def batch_rows_at(slots: Sequence[UOp], starts: Sequence[UOp], device: str) -> tuple[Tensor, Tensor]:
    """Each batch row's slot and position (bound variables) as (B,) int32 tensors."""
    from tinygrad import Tensor, dtypes

    def column(values: Sequence[UOp]) -> Tensor:
        return Tensor.stack(*[Tensor(v, device=device) for v in values]).cast(dtypes.int32)

    return column(slots), column(starts)


def slot_ordered_decode_attention(q: Tensor, cache: Tensor, slots: Tensor, starts: Tensor, tiles: UOp, *, span: int,
                                  tile: int, positions: Tensor, n_kv_heads: int) -> Tensor:
    """A decode batch, q (B, heads, 1, head_dim), row b at position starts[b] in slot slots[b] (`batch_rows_at`);
    the rows' slots are distinct, and below `span` but for padding rows (any slot from `span` up: they get zeros).
    The queries are summed into slot order (a one-hot over B rows: few values), slots [0, span) of `cache` (2,
    slots, kv_heads, rows, head_dim) attend over `tiles` whole tiles of `tile` rows (enough for the batch's
    longest), each masked past its own position (a slot no row holds sees its row 0 only), and each row takes its
    slot's result back. `positions` is arange over the cache's rows. Returns (B, heads, 1, head_dim)."""
    from tinygrad import dtypes

    batch, n_heads, _, hd = q.shape
    kvh, group, rows = n_kv_heads, n_heads // n_kv_heads, tiles * tile
    at = positions[0:span].reshape(span, 1) == slots.reshape(1, batch)
    queries = at.reshape(span, batch, 1).where(q.reshape(1, batch, n_heads * hd), 0).sum(1)
    pos = at.where(starts.reshape(1, batch), 0).sum(1, dtype=dtypes.int32)

    def rows_of(kv: Tensor, kind: int) -> Tensor:
        return kv[kind, 0:span, :, 0:rows, :].reshape(span, kvh, 1, tiles, tile, hd)

    visible = positions[0:rows].reshape(1, 1, 1, tiles, tile) <= pos.reshape(span, 1, 1, 1, 1)
    opts = slot_ordered_opts((span, kvh, group, hd, tile, cache.dtype.name))
    out = _over_tiles(queries.reshape(span, kvh, group, 1, 1, hd), cache, rows_of, visible, tile, opts)
    back = at.T.reshape(batch, span, 1).where(out.reshape(1, span, n_heads * hd), 0).sum(1)
    return back.reshape(batch, n_heads, 1, hd)


def grouped_query_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """`q.scaled_dot_product_attention(keys, values, attn_mask=mask, enable_gqa=True)`, the same arithmetic, with a
    KV head's query heads as rows of its products (`query_rows`). q (B, heads, T, head_dim); keys and values (B,
    kv_heads, L, head_dim); `mask` (B or 1, 1, T, L) is added to the scores."""
    from tinygrad import dtypes
    from tinygrad.dtype import least_upper_dtype

    acc = least_upper_dtype(q.dtype, keys.dtype, dtypes.float32)
    scores = (query_rows(q, keys.shape[1]) * keys.unsqueeze(2)).sum(-1, dtype=acc).cast(acc) / math.sqrt(q.shape[-1])
    return heads_of(masked_rows(scores, mask, q.shape[2]).cast(q.dtype).softmax(-1), values, q.shape)


def query_rows(q: Tensor, kv_heads: int) -> Tensor:
    """q (B, heads, T, head_dim) -> (B, kv_heads, group x T, 1, head_dim), written out: each KV head's query heads as
    rows of its products. Repeating the KV heads instead (`repeat_interleave`) makes the kernels find a query head's
    KV head with integer divisions in their innermost loop, several times the cost of the products on a CPU; and a
    query not written out is computed again (its RoPE) for every key."""
    batch, n_heads, T, hd = q.shape
    return q.contiguous().reshape(batch, kv_heads, n_heads // kv_heads * T, 1, hd)


def masked_rows(scores: Tensor, mask: Tensor | None, T: int | UOp) -> Tensor:
    """Scores (B, kv_heads, group x T, L) of `query_rows` plus `mask` (B or 1, 1, T, L), the same for every head."""
    if mask is None:
        return scores
    batch, kvh, rows, length = scores.shape
    grouped = scores.reshape(batch, kvh, rows // T, T, length) + mask.reshape(mask.shape[0], 1, 1, T, length)
    return grouped.reshape(batch, kvh, rows, length)


def heads_of(weights: Tensor, values: Tensor, q_shape: tuple) -> Tensor:
    """Attention weights (B, kv_heads, group x T, L) of `query_rows` times values (B, kv_heads, L, head_dim), back in
    the query's shape (B, heads, T, head_dim)."""
    return (weights.unsqueeze(-1) * values.unsqueeze(2)).sum(-2).reshape(q_shape)


def half_products_on() -> bool:
    """`SWARMD_HALF_PREFILL_ATTENTION=0` keeps a first chunk's attention products in float32 (for comparisons)."""
    return os.environ.get("SWARMD_HALF_PREFILL_ATTENTION", "1") != "0"


def half_product_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """q (1, heads, T, head_dim) over keys and values (1, kv_heads, L, head_dim), of concrete sizes (a prompt's
    first chunk on a GPU): both products as the weights' are, float16 inputs with float32 sums (shapes tinygrad
    gives to the tensor cores), the softmax in float32; `mask` (1, 1, T, L) is added to the scores. Head h reads kv head
    h // (heads / kv_heads), as `scaled_dot_product_attention(enable_gqa=True)` does. Returns float32."""
    from tinygrad import dtypes

    _, n_heads, T, hd = q.shape
    kvh, rows = keys.shape[1], keys.shape[2]
    group = n_heads // kvh
    qh = q.reshape(1, kvh, group * T, hd).cast(dtypes.float16)
    scores = qh.matmul(keys.cast(dtypes.float16).transpose(-1, -2), dtype=dtypes.float32) * (1 / math.sqrt(hd))
    scores = scores.reshape(1, kvh, group, T, rows)
    if mask is not None:
        scores = scores + mask.reshape(1, 1, 1, T, rows)  # the same for every head
    weights = scores.softmax(-1).reshape(1, kvh, group * T, rows).cast(dtypes.float16)
    return weights.matmul(values.cast(dtypes.float16), dtype=dtypes.float32).reshape(1, n_heads, T, hd)
