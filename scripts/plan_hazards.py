#!/usr/bin/env python3
"""Checks tinygrad's memory plan of a stage's blocks as scheduled for an NVIDIA GPU, on any machine: does every kernel
still read what the kernel that wrote each of its inputs wrote, once the planner has packed the step's buffers into
one arena? A kernel that reads memory another kernel reused in between is reported with both kernels' names.

Builds the first `--blocks` blocks of `kimi-k2-mini` on the CPU, taking the GPUs' paths (`gpu_schedule.py`), for a
decode step of `--batch` rows or a prompt chunk of `--chunk` tokens, without running them.

    .venv/bin/python scripts/plan_hazards.py --batch 1
    .venv/bin/python scripts/plan_hazards.py --chunk 10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="decode rows")
    parser.add_argument("--chunk", type=int, default=0, help="a prompt chunk of this many tokens instead")
    args = parser.parse_args()

    from gpu_schedule import gpu_stage, unrealised_blocks
    from tinygrad.schedule.memory import memory_plan_rewrite
    from tinygrad.uop.ops import Ops

    stage = gpu_stage("kimi-k2-mini", 0, args.blocks)
    linear = unrealised_blocks(stage, range(args.blocks), batch=args.batch, chunk=args.chunk).contiguous().schedule_linear()

    def outputs(call) -> set[int]:
        prog = call.src[0]
        return set(prog.arg.outs) if prog.op is Ops.PROGRAM else {0}

    def name(call) -> str:
        return call.src[0].arg.name if call.src[0].op is Ops.PROGRAM else "tinygrad kernel"

    def base(u):
        return u.src[0] if u.op is Ops.BUFFER_VIEW else u

    def region(u) -> tuple:
        if u.op is Ops.BUFFER_VIEW:
            return base(u), u.arg[1] * u.dtype.itemsize, (u.arg[1] + u.arg[0]) * u.dtype.itemsize
        return u, 0, u.arg * u.dtype.itemsize

    written = {base(c.src[1 + j]) for c in linear.src for j in outputs(c)}
    inputs = {base(u) for c in linear.src for u in c.src[1:]} - written  # weights, caches, the step's input
    planned = memory_plan_rewrite(linear, inputs | {base(linear.src[-1].src[1])})

    def last_writer(writes: list, r: tuple) -> int | None:
        hits = [k for k, w in writes if w[0] is r[0] and w[1] < r[2] and r[1] < w[2]]
        return hits[-1] if hits else None

    before: list = []
    after: list = []
    hazards = 0
    for k, (call, plan) in enumerate(zip(linear.src, planned.src, strict=True)):
        for j, (u, p) in enumerate(zip(call.src[1:], plan.src[1:], strict=True)):
            if j in outputs(call):
                continue
            want, got = last_writer(before, region(u)), last_writer(after, region(p))
            if want != got:
                hazards += 1
                print(f"kernel {k} ({name(call)}) reads input {j} of kernel {want} "
                      f"({name(linear.src[want]) if want is not None else 'outside the step'}), "
                      f"but the plan has kernel {got} ({name(linear.src[got]) if got is not None else '-'}) "
                      "write there last")
        for j in outputs(call):
            before.append((k, region(call.src[1 + j])))
            after.append((k, region(plan.src[1 + j])))
    print(f"{len(linear.src)} kernels, {hazards} hazards")


if __name__ == "__main__":
    main()
