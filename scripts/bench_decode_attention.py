#!/usr/bin/env python3
"""A decode batch's attention on a GPU, in slot order (models/kernels/attention.py), and a search of its kernels.

For each batch size: the device time of one layer's slot-ordered attention (the rows' KV stores, the scores, the
softmax and the weighted sum), timed kernel by kernel with events, with the options in `SLOT_ORDERED_OPTS`, with
tinygrad's heuristics, and (`--beam N`) after tinygrad's BEAM search of every kernel, whose options it prints per
kernel (the table to pin). Llama-3.1-8B's attention shapes (32 heads, 8 KV heads, head_dim 128) by default. Ends
with one JSON line (and one after each batch size).

    python3 scripts/bench_decode_attention.py --batches 8,32 --context 640 --beam 4

`--latent`: one decoded token's multi-head latent attention over whole tiles instead (`tiled_latent_attention`,
every row of a batch alike), Kimi-K2's shapes by default (64 heads over a latent of 576, values its first 512),
the options of `LATENT_OPTS` against the heuristics and the search:

    python3 scripts/bench_decode_attention.py --latent --context 512 --beam 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(batch: int, context: int, max_context: int, kv_dtype: str, heads: int, kv_heads: int, head_dim: int,
          tile: int):
    """A function that returns one layer's attention (lazy) for `batch` rows in slots 0..batch-1, as a stage's
    decode step builds it: each row's new K/V stored in its slot, then the cache read back through the stores."""
    import numpy as np
    from tinygrad import Tensor, UOp, dtypes

    from models.kernels.attention import batch_rows_at, slot_ordered_decode_attention, slot_span

    rng = np.random.default_rng(0)
    most_tiles = -(-max_context // tile)
    rows = most_tiles * tile
    kv = Tensor(rng.standard_normal((2, batch + 1, kv_heads, rows, head_dim), dtype=np.float32)).cast(
        getattr(dtypes, kv_dtype)).contiguous().realize()
    q = Tensor(rng.standard_normal((batch, heads, 1, head_dim), dtype=np.float32)).realize()
    new = Tensor(rng.standard_normal((batch, 2, kv_heads, 1, head_dim), dtype=np.float32)).realize()
    positions = Tensor.arange(rows).realize()
    at = [context - 1 - b for b in range(batch)]  # the rows' positions differ a little, as a batch's do
    svars = [UOp.variable(f"slot{b}", 0, batch).bind(b) for b in range(batch)]
    pvars = [UOp.variable(f"pos{b}", 0, max_context - 1).bind(p) for b, p in enumerate(at)]
    tiles = UOp.variable("tiles", 1, most_tiles).bind(max(at) // tile + 1)
    span = slot_span(range(batch), batch)

    def attention():
        stores = [kv[:, s:s + 1, :, p:p + 1, :].uop.store(new[b:b + 1].reshape(2, 1, kv_heads, 1, head_dim)
                                                          .cast(kv.dtype).uop)
                  for b, (s, p) in enumerate(zip(svars, pvars, strict=True))]
        cache = Tensor(kv.uop.after(*stores))
        return slot_ordered_decode_attention(q, cache, *batch_rows_at(svars, pvars, q.device), tiles, span=span,
                                             tile=tile, positions=positions, n_kv_heads=kv_heads)

    return attention


def build_latent(context: int, max_context: int, kv_dtype: str, heads: int, width: int, values: int, tile: int):
    """A function that returns one layer's latent attention (lazy) for one decoded token at position context-1
    of slot 0, as a stage's decode step builds it: the token's latent stored, then the cache read back."""
    import numpy as np
    from tinygrad import Tensor, UOp, dtypes

    from models.kernels.attention import tiled_latent_attention

    rng = np.random.default_rng(0)
    most_tiles = -(-max_context // tile)
    rows = most_tiles * tile
    cache = Tensor(rng.standard_normal((2, rows, width), dtype=np.float32)).cast(
        getattr(dtypes, kv_dtype)).contiguous().realize()
    q = Tensor(rng.standard_normal((1, heads, 1, width), dtype=np.float32) / np.sqrt(width)).realize()
    new = Tensor(rng.standard_normal((1, 1, width), dtype=np.float32)).realize()
    positions = Tensor.arange(rows).realize()
    slot = UOp.variable("slot0", 0, 1).bind(0)
    pos = UOp.variable("pos0", 0, max_context - 1).bind(context - 1)
    tiles = UOp.variable("tiles0", 1, most_tiles).bind((context - 1) // tile + 1)

    def attention():
        store = cache[slot:slot + 1, pos:pos + 1, :].uop.store(new.cast(cache.dtype).uop)
        return tiled_latent_attention(q, Tensor(cache.uop.after(store)), slot, pos, tiles, tile=tile,
                                      positions=positions, values=values, scale=1 / np.sqrt(192))

    return attention


def per_kernel(fn) -> list[tuple[str, float]]:
    """fn()'s kernels, each (name, device seconds), timed with events (tinygrad DEBUG=2)."""
    import contextlib
    import io

    from tinygrad.helpers import Context

    from scripts.bench_gpu import kernel_times

    buf = io.StringIO()
    with Context(DEBUG=2), contextlib.redirect_stdout(buf):
        fn()
    return kernel_times(buf.getvalue())


def measure(attention, reps: int) -> dict:
    """The median over `reps` runs of each kernel's time and their sum (us)."""
    import statistics

    attention().realize()  # compile
    runs = [per_kernel(lambda: attention().realize()) for _ in range(reps)]
    names = [n for n, _ in runs[0]]
    times = [statistics.median(r[i][1] for r in runs if len(r) == len(names)) * 1e6 for i in range(len(names))]
    return {"total_us": round(sum(times), 1), "kernels": [[n, round(t, 1)] for n, t in zip(names, times, strict=True)]}


def with_table(table: dict | None) -> None:
    """Sets SWARMD_ATTENTION_OPTS to a file holding `table` (None: the built-in table)."""
    os.environ.pop("SWARMD_ATTENTION_OPTS", None)
    if table is not None:
        path = Path(tempfile.gettempdir(), f"attention-opts-{os.getpid()}.json")
        path.write_text(json.dumps(table))
        os.environ["SWARMD_ATTENTION_OPTS"] = str(path)


def beam(attention, amount: int) -> list[dict]:
    """tinygrad's BEAM search of each kernel of `attention` (none pinned): each kernel's shape and found options."""
    import tinygrad.codegen.opt.search as search
    from tinygrad.helpers import Context

    found, original = [], search.beam_search

    def recording(s, rawbufs, amt, *args, **kwargs):
        best = original(s, rawbufs, amt, *args, **kwargs)
        found.append({"shape": [x if isinstance(x, int) else x.render() for x in s.full_shape],
                      "axes": [t.name for t in s.axis_types],
                      "opts": [[o.op.name, o.axis, o.arg] for o in best.applied_opts]})
        return best

    search.beam_search = recording
    try:
        with Context(BEAM=amount):
            attention().realize()
    finally:
        search.beam_search = original
    return found


def main() -> None:
    from tinygrad import Device
    from tinygrad.helpers import Context

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="8,32")
    p.add_argument("--context", type=int, default=640, help="the batch's longest position + 1")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--kv-dtypes", default="float32", help="the KV cache's dtypes to measure, comma-separated")
    p.add_argument("--beam", type=int, default=0, help="BEAM width of a search of every kernel (0: no search)")
    p.add_argument("--table", default="", help="a JSON file of options to measure beside the built-in table")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--heads", type=int, help="query heads (default 32; 64 with --latent)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, help="(default 128; with --latent the latent's width, 576)")
    p.add_argument("--tile", type=int, default=128)
    p.add_argument("--latent", action="store_true", help="one token's latent attention (--batches is ignored)")
    p.add_argument("--values", type=int, default=512, help="with --latent: the values' width")
    args = p.parse_args()
    args.heads = args.heads or (64 if args.latent else 32)
    args.head_dim = args.head_dim or (576 if args.latent else 128)
    report: dict = {"device": Device.DEFAULT, "context": args.context}
    for dtype in args.kv_dtypes.split(","):
        for batch in ([1] if args.latent else [int(b) for b in args.batches.split(",")]):
            att = build_latent(args.context, args.max_context, dtype, args.heads, args.head_dim, args.values,
                               args.tile) if args.latent else \
                build(batch, args.context, args.max_context, dtype, args.heads, args.kv_heads, args.head_dim,
                      args.tile)
            row: dict = {}
            configs = [("table", None), ("heuristics", {})]
            if args.table:
                configs.append(("given", json.loads(Path(args.table).read_text())))
            for name, table in configs:
                with_table(table)
                row[name] = measure(att, args.reps)
            if args.beam:
                with_table({})
                row["beam_opts"] = beam(att, args.beam)
                with Context(BEAM=args.beam):  # the searched options, from tinygrad's cache
                    row["beam"] = measure(att, args.reps)
            with_table(None)
            report[f"{dtype}_b{batch}"] = row
            print(f"{dtype} b{batch}:", {k: v["total_us"] for k, v in row.items() if isinstance(v, dict)},
                  flush=True)
            print(json.dumps({f"{dtype}_b{batch}": row}), flush=True)  # what is measured survives a timeout
    print(json.dumps(report))


if __name__ == "__main__":
    main()
