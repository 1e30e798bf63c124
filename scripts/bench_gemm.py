#!/usr/bin/env python3
"""The float16 tensor-core product on a GPU: `models.kernels.gemm` against tinygrad's own kernels and torch.

For each product shape (rows x out x in; Llama-3.1-8B's four at a 512-row prompt chunk by default), times
x @ w.T three ways, each a captured graph of the product with `--copies` weight matrices (as a model's layers, so
neither the launch nor a cache warm from the last replay hides the kernel's own time) replayed `--reps` times
(median of `--rounds`, per product): the hand-written kernel
with each tiling of `--tilings`, tinygrad's kernel as `tensor_core_matmul` builds it without the hand-written one
(its searched options included), and torch's float16 matmul (cuBLAS) where torch is installed. Each result is
checked against a float32 product of the same float16 operands.

    python3 scripts/bench_gemm.py
    python3 scripts/bench_gemm.py --shapes 512x28672x4096 --tilings 64,128,64,2,2,2 128,128,32,2,4,3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_8B_CHUNK = ("512x6144x4096", "512x4096x4096", "512x28672x4096", "512x4096x14336")


def timed(fn, reps: int, rounds: int, sync) -> float:
    """Median seconds per call over `rounds` rounds of `reps` calls."""
    times = []
    for _ in range(rounds):
        sync()
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - started) / reps)
    return statistics.median(times)


def bench_shape(shape: str, tilings: list[str], reps: int, rounds: int, copies: int, use_torch: bool) -> list[dict]:
    """The rows of one product shape: each engine's median time, rate and error."""
    import numpy as np
    from tinygrad import Device, Tensor, TinyJit, dtypes

    from models.kernels.gemm import Tiling, gemm, gemm_fits, tiling
    from models.kernels.matvec import tensor_core_matmul

    dev = Device.DEFAULT
    rows, out_f, in_f = (int(v) for v in shape.split("x"))
    rng = np.random.default_rng(rows + out_f + in_f)
    xn = (rng.standard_normal((rows, in_f)) * 0.5).astype(np.float16)
    wn = (rng.standard_normal((out_f, in_f)) * 0.02).astype(np.float16)
    x, w = Tensor(xn, device=dev).realize(), Tensor(wn, device=dev).realize()
    ws = [w] + [(w + 0).realize() for _ in range(copies - 1)]
    want = (x.cast(dtypes.float32) @ w.cast(dtypes.float32).T).realize().numpy()
    scale = float(np.abs(want).max())
    results = []

    def report(engine: str, seconds: float, got) -> None:
        err = float(np.abs(got - want).max()) / scale
        row = {"shape": shape, "engine": engine, "us": seconds * 1e6,
               "tflops": 2 * rows * out_f * in_f / seconds / 1e12, "error": err}
        results.append(row)
        print(f"| {shape} | {engine} | {row['us']:.1f} | {row['tflops']:.1f} | {err:.2e} |", flush=True)

    engines = []
    for t in [Tiling.parse(spec) for spec in tilings] or [tiling(rows, out_f, in_f)]:
        if gemm_fits(dev, rows, out_f, in_f, t):
            engines.append((f"gemm {t.spec}", lambda x, w, t=t: gemm(x, w, t)))
        else:
            print(f"| {shape} | gemm {t.spec} | does not fit | | |")
    engines.append(("tinygrad", tensor_core_matmul))
    for engine, product in engines:
        if engine == "tinygrad":
            os.environ["SWARMD_GEMM"] = "0"  # tensor_core_matmul without the hand-written kernel
        def products(x: Tensor, product=product) -> Tensor:
            outs = [product(x, w) for w in ws]
            Tensor.realize(*outs)
            return outs[0]

        step = TinyJit(products)
        try:
            for _ in range(3):
                got = step(x)
            seconds = timed(lambda step=step: step(x), reps, rounds, Device[dev].synchronize) / copies
            report(engine, seconds, got.numpy())
        except Exception as e:  # a tiling that does not compile or launch costs its row only
            print(f"| {shape} | {engine} | failed: {type(e).__name__}: {str(e)[:300]} | | |", flush=True)
    os.environ.pop("SWARMD_GEMM", None)
    if use_torch:
        try:
            import torch
        except ImportError:
            return results
        if torch.cuda.is_available():
            tx, tw = torch.from_numpy(xn).cuda(), torch.from_numpy(wn).cuda()
            tws = [tw] + [tw.clone() for _ in range(copies - 1)]
            for _ in range(3):
                got = (tx @ tw.T).float()
            seconds = timed(lambda: [tx @ w.T for w in tws], reps, rounds, torch.cuda.synchronize) / copies
            report("torch", seconds, got.cpu().numpy())
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(LLAMA_8B_CHUNK), help="rows x out x in")
    ap.add_argument("--tilings", nargs="+", default=[], help="bm,bn,bk,warps_m,warps_n,stages[,split] "
                    "(default: the one models.kernels.gemm picks for the shape's rows)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()

    from tinygrad import Device

    print(f"device {Device.DEFAULT}; median of {args.rounds} rounds of {args.reps} replays")
    print("| product (rows x out x in) | engine | us | TFLOP/s | max error / max value |")
    print("|---|---|---|---|---|")
    rows = [r for shape in args.shapes for r in bench_shape(shape, args.tilings, args.reps, args.rounds,
                                                            args.copies, not args.no_torch)]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gemm.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
