#!/usr/bin/env python3
"""A prompt chunk's or a decode batch's weight products on a GPU (`tensor_core_matmul`, models/kernels/matvec.py), and a
search of them.

For each product of a Llama-3.1-8B layer (the fused q/k/v, the attention output, the fused gate/up, the down
projection; float16 weights, float32 activations rounded to float16 in the kernel's input): its device time for
`--rows` rows (fewer than 64: a decode batch's split product and its sum), timed kernel by kernel with events,
with the options pinned in `TENSOR_CORE_OPTS` (where the shape is there), with tinygrad's heuristics and
(`--beam N`) after tinygrad's BEAM search, whose options it prints (the table to pin). Ends with one JSON line.

    python3 scripts/bench_prefill_products.py --rows 512 --beam 4
    python3 scripts/bench_prefill_products.py --rows 8 --beam 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, out features, in features) of one Llama-3.1-8B layer
PRODUCTS = (("qkv", 6144, 4096), ("attn_output", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def build(rows: int, out_features: int, in_features: int):
    """A function that returns x @ w.T (lazy) as a stage's prefill chunk computes it."""
    from tinygrad import Tensor, dtypes

    from models.kernels.matvec import tensor_core_matmul

    x = Tensor.randn(rows, in_features, dtype=dtypes.float32).realize()
    w = (Tensor.randn(out_features, in_features, dtype=dtypes.float32) * 0.02).cast(dtypes.float16).realize()
    return lambda: tensor_core_matmul(x, w)


def main() -> None:
    from scripts.bench_decode_attention import beam, measure

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--products", default=",".join(name for name, _, _ in PRODUCTS))
    p.add_argument("--beam", type=int, default=0, help="BEAM width of a search of every kernel (0: no search)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()

    from tinygrad.helpers import Context

    none = Path(tempfile.gettempdir(), f"tensor-core-opts-{os.getpid()}.json")
    none.write_text("{}")  # SWARMD_TENSOR_CORE_OPTS naming it: no product pinned, tinygrad chooses (or searches)
    out = {}
    for name, n_out, n_in in PRODUCTS:
        if name not in args.products.split(","):
            continue
        product = build(args.rows, n_out, n_in)
        os.environ.pop("SWARMD_TENSOR_CORE_OPTS", None)
        row = {"table": measure(product, args.reps)}
        os.environ["SWARMD_TENSOR_CORE_OPTS"] = str(none)
        row["heuristics"] = measure(product, args.reps)
        if args.beam:
            row["beam_opts"] = beam(product, args.beam)
            with Context(BEAM=args.beam):  # the searched options, from tinygrad's cache
                row["beam"] = measure(product, args.reps)
        flops = 2 * args.rows * n_out * n_in
        for kind in ("table", "heuristics", "beam"):
            if kind in row:
                us = row[kind]["total_us"]
                print(f"{name:12s} {kind:10s} {us:9.1f} us  {flops / us / 1e6:7.1f} TFLOP/s", flush=True)
        out[name] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()
