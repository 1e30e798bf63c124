#!/usr/bin/env python3
"""A decode step's products with 4-bit GGML-block matrices on a GPU: `models.kernels.block_gemv` against tinygrad's
kernel (`block_matvec` without it).

For each case (a Kimi-K2 block's matrices by default: the 8 chosen experts' gate+up and down, gathered from a stack,
and the single matrices), times the product in a captured graph of `--copies` products with matrices of their own
(as a model's layers, so that no cache warm from the last replay hides the reads), median of `--rounds` rounds of
`--reps` replays, and reports the weight bytes read per second. Each result is checked against a float64 product
of the weights as `gguf` dequantises them.

    python3 scripts/bench_block_gemv.py
    python3 scripts/bench_block_gemv.py --rows 8 --layouts 4,4 2,4 4,4,8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (slots, out, in, stack); stack 0: one matrix; else the slots gather distinct matrices of a stack that size
KIMI_CASES = {
    "experts gate+up": (8, 4096, 7168, 32), "experts down": (8, 7168, 2048, 32),
    "q_a + kv_a": (1, 2112, 7168, 0), "q_b": (1, 12288, 1536, 0), "o": (1, 7168, 8192, 0),
    "shared gate+up": (1, 4096, 7168, 0), "shared down": (1, 7168, 2048, 0),
    # a batch of 8 rows' 64 (row, expert) pairs, each pair a slot
    "64 pairs gate+up": (64, 4096, 7168, 64), "64 pairs down": (64, 7168, 2048, 64),
}


def random_blocks(rng: np.random.Generator, matrices: int, out: int, width: int, q4_1: bool) -> np.ndarray:
    """The raw GGML bytes of `matrices` (out, width) Q4_0 (or Q4_1) matrices with small scales."""
    nb = width // 32
    per = 20 if q4_1 else 18
    raw = rng.integers(0, 256, (matrices * out, nb, per), dtype=np.uint8)
    raw[..., 0:2] = (rng.uniform(0.002, 0.02, (matrices * out, nb)).astype(np.float16)
                     .view(np.uint8).reshape(matrices * out, nb, 2))
    if q4_1:
        raw[..., 2:4] = (rng.uniform(-0.05, 0.05, (matrices * out, nb)).astype(np.float16)
                         .view(np.uint8).reshape(matrices * out, nb, 2))
    return raw


def bench_case(name: str, case: tuple, rows: int, layouts: list[str], args) -> list[dict]:
    from bench_gemm import timed
    from gguf.quants import dequantize
    from tinygrad import Device, Tensor, TinyJit

    from models.kernels.block_gemv import block_gemv_fits
    from models.kernels.gathered import block_matvec
    from models.kernels.quant import from_ggml_blocks

    dev = Device.DEFAULT
    slots, out, width, stack = case
    matrices = stack or 1
    rng = np.random.default_rng(out + width)
    raw = random_blocks(rng, matrices, out, width, args.q4_1)
    ggml_type = 3 if args.q4_1 else 2
    shape = (matrices, out, width) if stack else (out, width)
    copies = [from_ggml_blocks(raw, ggml_type, shape, dev).realize()]
    for _ in range(args.copies - 1):  # the same values in buffers of their own
        copies.append(from_ggml_blocks(raw, ggml_type, shape, dev).realize())
    xn = rng.standard_normal((slots, rows, width)).astype(np.float32)
    pick = (np.arange(slots) * 7 % matrices).astype(np.int32) if stack else np.zeros(slots, np.int32)
    x = Tensor(xn, device=dev).realize()
    idx = Tensor(pick, device=dev).realize() if stack else None
    w64 = dequantize(raw.reshape(matrices * out, -1), ggml_type).astype(np.float64).reshape(matrices, out, width)
    want = np.einsum("sri,soi->sro", xn.astype(np.float64), w64[pick])
    scale = float(np.abs(want).max())
    weight_bytes = slots * out * width * (20 if args.q4_1 else 18) // 32 if stack else out * width * (
        20 if args.q4_1 else 18) // 32
    results = []
    for engine in ["tinygrad", *layouts]:
        if engine == "tinygrad":
            os.environ["SWARMD_BLOCK_GEMV"] = "0"
        else:
            os.environ.pop("SWARMD_BLOCK_GEMV", None)
            os.environ["SWARMD_BLOCK_GEMV_LAYOUT"] = engine
            if not block_gemv_fits(x, copies[0], gathered=bool(stack)):
                print(f"| {name} | {rows} | {engine} | does not fit | | |", flush=True)
                continue

        def step(x, *_ws, idx=idx):
            return [block_matvec(x, w, idx).realize() for w in copies]

        jit = TinyJit(step)
        for _ in range(3):
            got = jit(x)
        got = got[0].numpy()
        seconds = timed(lambda jit=jit: jit(x), args.reps, args.rounds, Device[dev].synchronize) / len(copies)
        err = float(np.abs(got - want).max()) / scale
        row = {"case": name, "rows": rows, "engine": engine, "us": seconds * 1e6,
               "gb_s": weight_bytes / seconds / 1e9, "error": err}
        results.append(row)
        print(f"| {name} | {rows} | {engine} | {row['us']:.1f} | {row['gb_s']:.0f} | {err:.1e} |", flush=True)
    os.environ.pop("SWARMD_BLOCK_GEMV", None)
    os.environ.pop("SWARMD_BLOCK_GEMV_LAYOUT", None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(KIMI_CASES), help="names of KIMI_CASES")
    parser.add_argument("--rows", default="1,8", help="rows per slot, comma-separated")
    parser.add_argument("--layouts", nargs="*", default=["4,4"],
                        help="the hand-written kernel's layouts, each per_warp,warps[,lane_bytes]")
    parser.add_argument("--q4-1", action="store_true", help="Q4_1 blocks instead of Q4_0")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="a folder for results.json")
    args = parser.parse_args()
    print("| case | rows | engine | us | GB/s of weights | error |\n|---|---|---|---|---|---|", flush=True)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name in args.cases:
            results += bench_case(name, KIMI_CASES[name], rows, args.layouts, args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
