#!/usr/bin/env python3
"""The kernels of one decode step's MoE block as tinygrad schedules them for an NVIDIA GPU, listed on any machine.

Builds block 1 of `kimi-k2-mini` (its GGUF file, written on first use; `--model` names another) on the CPU, which takes the GPUs' paths, with
the hand-written kernels' checks answering as for an sm_90 GPU, builds the block's decode step for `--batch` rows without running it, and
prints its schedule: each hand-written kernel by name, each tinygrad kernel with the sizes of its buffers (output
first) and the operations it does, then which earlier kernels' outputs each one reads. A copy shows as a tinygrad
kernel with no arithmetic. What differs from a GPU's graph: the realisations inside the block are left lazy (the
cache after its write shows as a copy of the whole cache), the latent attention is tinygrad's (the mini model's
latent is narrower than the kernel takes), and the routed experts take the CPU's exact path.

    .venv/bin/python scripts/kernel_census.py --batch 1
    .venv/bin/python scripts/kernel_census.py --model smollm2-135m --sources
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="kimi-k2-mini", help="a model name or GGUF file (default: kimi-k2-mini)")
    parser.add_argument("--batch", type=int, default=1, help="decode rows")
    parser.add_argument("--sources", action="store_true", help="also list which kernels' outputs each one reads")
    args = parser.parse_args()

    from gpu_schedule import gpu_stage, unrealised_blocks
    from tinygrad.uop.ops import Ops

    stage = gpu_stage(args.model, 1, 2)
    out = unrealised_blocks(stage, range(1, 2), batch=args.batch)
    calls = out.contiguous().schedule_linear().src

    def key(buf):
        return (buf.src[0], buf.arg) if buf.op is Ops.BUFFER_VIEW else (buf, None)

    def size(buf) -> str:
        return f"{buf.arg[0] if buf.op is Ops.BUFFER_VIEW else buf.arg}{buf.dtype.name[0]}"

    written: dict = {}
    for k, call in enumerate(calls):
        prog, bufs = call.src[0], call.src[1:]
        sizes = " ".join(size(u) for u in bufs)
        if prog.op is Ops.PROGRAM:
            print(f"{k:3d} {prog.arg.name:44s} {sizes}")
        else:
            ops = sorted({u.op.name for u in prog.toposort()
                          if u.op.name in ("REDUCE", "EXP2", "RECIPROCAL", "SQRT", "WHERE", "MAX", "CAST", "CMPLT")})
            kind = "reduce" if "REDUCE" in ops else "elementwise"
            print(f"{k:3d} tinygrad {kind:35s} {sizes}  {' '.join(o for o in ops if o != 'REDUCE')}")
        if args.sources:
            print("      reads", [written.get(key(u), "-") for u in bufs[1:]])
        written.setdefault(key(bufs[0]), k)
    print(f"{len(calls)} kernels")


if __name__ == "__main__":
    main()
