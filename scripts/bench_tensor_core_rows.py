#!/usr/bin/env python3
"""A decode batch's products with the weights on a GPU: the split-reduction matvec against the tensor-core matmul.

For each matrix a Llama-shaped decode step reads (fused qkv, attention output, gate_up, down, head) and each
row count: device time of the matvec kernel with its table options (models/kernels/matvec.py
`GPU_MATVEC_OPTS`) and of `tensor_core_matmul` with the reduction in 1, 2, 4, ... parts, as GB/s of weights
(each kernel timed by events, weight copies rotated past the L2 cache), and each product's largest difference
from the matvec's. Ends with one JSON line.

    python3 scripts/bench_tensor_core_rows.py --arch llama-3.1-8b --rows 8,16,32 --splits 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_product(x, ws: list, split: int | None) -> tuple[float, object]:
    """Device seconds of x @ w.T over the rotated weight copies, and its value on the first: the matvec with its
    table options (split None) or `tensor_core_matmul` with the reduction in `split` parts."""
    from tinygrad import Device

    from models.kernels.matvec import _split_matvec, gpu_matvec_opts, tensor_core_matmul
    from scripts.bench_gpu import kernel_seconds

    rows, width = x.shape
    out = ws[0].shape[0]
    opts = gpu_matvec_opts(Device.DEFAULT, rows, out, width) or None
    if split is not None:
        os.environ["SWARMD_TENSOR_CORE_SPLIT"] = str(split)

    def product(w):
        if split is None:
            return _split_matvec(x, w, view=(width,), opts=opts)
        return tensor_core_matmul(x, w)

    turn = iter(range(1 << 30))
    value = product(ws[0]).realize().numpy()
    return kernel_seconds(lambda: product(ws[next(turn) % len(ws)]).realize(), 2 * len(ws)), value


def main() -> None:
    from tinygrad import Device, Tensor, dtypes

    from scripts.bench_gpu import arch_spec, matrix_shapes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="llama-3.1-8b")
    p.add_argument("--rows", default="8,16,32")
    p.add_argument("--splits", default="1,2,4,8,16,32")
    p.add_argument("--out", default="")
    args = p.parse_args()
    dev = Device.DEFAULT
    arch = arch_spec(args.arch)
    results: dict = {"device": dev, "arch": args.arch}
    splits = [int(s) for s in args.splits.split(",")]
    for name, (o, i) in matrix_shapes(arch).items():
        copies = min(8, max(2, math.ceil(4 * 60e6 / (o * i * 2))))  # rotate past the L2 cache
        ws = [Tensor.randn(o, i, dtype=dtypes.half, device=dev).realize() for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = (Tensor.randn(rows, i, device=dev) / math.sqrt(i)).realize()
            ref = None
            for split in [None, *(s for s in splits if i % (16 * s) == 0)]:
                label = "matvec" if split is None else f"tc{split}"
                try:
                    t, y = time_product(x, ws, split)
                except Exception as e:  # a variant tinygrad refuses costs its cell only
                    results.setdefault("errors", []).append(f"{name} {rows} {label}: {str(e).splitlines()[0][:160]}")
                    continue
                ref = y if ref is None else ref
                cell = {"gb_s": round(o * i * 2 / t / 1e9, 1), "us": round(t * 1e6, 1),
                        "max_diff": float(abs(y - ref).max()), "max_abs": float(abs(ref).max())}
                results.setdefault(name, {}).setdefault(str(rows), {})[label] = cell
                print(f"{name:8} {o:6}x{i:<6} rows {rows:3} {label:7} {cell['gb_s']:8.1f} GB/s {cell['us']:9.1f} us"
                      f"  diff {cell['max_diff']:.2e} of {cell['max_abs']:.2f}", flush=True)
        os.environ.pop("SWARMD_TENSOR_CORE_SPLIT", None)
        del ws
    if args.out:
        Path(args.out, "tensor_core_rows.json").write_text(json.dumps(results))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
