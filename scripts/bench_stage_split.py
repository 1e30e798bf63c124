#!/usr/bin/env python3
"""Where a pipeline stage's fixed cost per step lies: one process, no network, the whole model against its parts.

    python3 scripts/bench_stage_split.py --arch llama-3.1-8b --parts 1,2,4 --steps 32

For each split into P parts (P stages of equal block ranges, seeded weights, the default device), one
request decodes --steps batch-1 steps through the parts in turn, as a pipeline's stages would, and each
part's `StageModel.forward` is timed by the wall clock. If the parts' times add up to the whole model's,
a stage step costs nothing fixed in the model and a pipeline's extra time per token lies in the daemons;
if not, the difference per part is the model's fixed cost of a step (input copy, graph launch, reading
the output back). Markdown on stdout.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = 32


def split_times(arch_name: str, parts: int, steps: int) -> list[float]:
    """Median wall seconds of each part's forward over `steps` decode steps."""
    from models.config import config_from_arch
    from models.stage import StageInput, StageModel
    from planner.arch import BUILTIN_ARCHS

    arch = BUILTIN_ARCHS[arch_name]
    context = PROMPT + steps + 8
    config = config_from_arch(arch, context)
    bounds = [round(i * arch.n_blocks / parts) for i in range(parts + 1)]
    stages = [StageModel.random(config, 0, a, b, max_context=context, max_requests=1)
              for a, b in itertools.pairwise(bounds)]
    for s in stages:
        s.add_request("r")

    def step(pos: int, data: np.ndarray, times: list[list[float]] | None) -> int:
        for i, s in enumerate(stages):
            t = time.perf_counter()
            data = s.forward([StageInput("r", pos, data)])[0]
            if times is not None:
                times[i].append(time.perf_counter() - t)
        return int(np.asarray(data).argmax())

    token = step(0, np.arange(1, PROMPT + 1), None)
    for k in range(3):  # captures the decode graphs
        token = step(PROMPT + k, np.array([token]), None)
    times: list[list[float]] = [[] for _ in stages]
    for k in range(steps):
        token = step(PROMPT + 3 + k, np.array([token]), times)
    return [statistics.median(t) for t in times]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama-3.1-8b")
    p.add_argument("--parts", default="1,2,4", help="splits to time, comma-separated (default: 1,2,4)")
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    from tinygrad import Device

    print(f"{args.arch}, seeded weights, device {Device.DEFAULT}, {args.steps} batch-1 decode steps; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    print("| parts | each part's forward, ms (median) | sum, ms | sum - whole model, per extra part, ms |")
    print("|---|---|---|---|")
    whole = None
    for parts in (int(x) for x in args.parts.split(",")):
        got = split_times(args.arch, parts, args.steps)
        total = sum(got) * 1e3
        whole = total if whole is None else whole
        extra = (total - whole) / (parts - 1) if parts > 1 else 0.0
        print(f"| {parts} | {', '.join(f'{t * 1e3:.2f}' for t in got)} | {total:.2f} | {extra:+.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
