#!/usr/bin/env python3
"""Where a pipeline stage's fixed cost per step lies: one process, no network, the whole model against its parts.

    python3 scripts/bench_stage_split.py --arch llama-3.1-8b --parts 1,2,4 --steps 32

For each split into P parts (P stages of equal block ranges, seeded weights, the default device), one
request decodes --steps batch-1 steps through the parts in turn, as a pipeline's stages would, and each
part's `StageModel.forward` is timed by the wall clock. If the parts' times add up to the whole model's,
a stage step costs nothing fixed in the model and a pipeline's extra time per token lies in the daemons;
if not, the difference per part is the model's fixed cost of a step (input copy, graph launch, reading
the output back). Markdown on stdout.

With --processes, each part of a split also runs in a process of its own on the same device, the parts
chained by pipes and the last one's token sent back to the first: what separate processes cost on one
device (on a GPU, its switches between the processes' contexts) without any of the daemons' work.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = 32


def make_stage(arch_name: str, parts: int, part: int, steps: int):  # -> StageModel, imported late
    from models.config import config_from_arch
    from models.stage import StageModel
    from planner.arch import BUILTIN_ARCHS

    arch = BUILTIN_ARCHS[arch_name]
    context = PROMPT + steps + 8
    bounds = [round(i * arch.n_blocks / parts) for i in range(parts + 1)]
    stage = StageModel.random(config_from_arch(arch, context), 0, bounds[part], bounds[part + 1],
                              max_context=context, max_requests=1)
    stage.add_request("r")
    return stage


def split_times(arch_name: str, parts: int, steps: int) -> list[float]:
    """Median wall seconds of each part's forward over `steps` decode steps."""
    from models.stage import StageInput

    stages = [make_stage(arch_name, parts, i, steps) for i in range(parts)]

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


def _part_loop(arch_name: str, parts: int, part: int, steps: int, inbox, outbox, report) -> None:
    """One part in its own process: forward whatever arrives, pass the result on, report its times."""
    from models.stage import StageInput

    stage = make_stage(arch_name, parts, part, steps)
    report.send("ready")
    times = []
    while (msg := inbox.recv()) is not None:
        pos, data, timed = msg
        t = time.perf_counter()
        out = stage.forward([StageInput("r", pos, data)])[0]
        if timed:
            times.append(time.perf_counter() - t)
        outbox.send((pos, int(np.asarray(out).argmax()) if part == parts - 1 else np.asarray(out), timed))
    report.send(statistics.median(times))


def process_times(arch_name: str, parts: int, steps: int) -> tuple[list[float], float]:
    """Each part's median forward and the median token time, with every part in a process of its own."""
    ctx = mp.get_context("spawn")
    links = [ctx.Pipe(duplex=False) for _ in range(parts + 1)]  # (receiving end, sending end)
    reports = [ctx.Pipe(duplex=False) for _ in range(parts)]
    procs = [ctx.Process(target=_part_loop, daemon=True,
                         args=(arch_name, parts, i, steps, links[i][0], links[i + 1][1], reports[i][1]))
             for i in range(parts)]
    for proc in procs:
        proc.start()
    for r, _ in reports:
        r.recv()
    first, last = links[0][1], links[parts][0]

    def step(pos: int, data: np.ndarray, timed: bool) -> int:
        first.send((pos, data, timed))
        return last.recv()[1]

    token_times = []
    token = step(0, np.arange(1, PROMPT + 1), False)
    for k in range(3):
        token = step(PROMPT + k, np.array([token]), False)
    for k in range(steps):
        t = time.perf_counter()
        token = step(PROMPT + 3 + k, np.array([token]), True)
        token_times.append(time.perf_counter() - t)
    for i in range(parts):
        links[i][1].send(None)
    got = [r.recv() for r, _ in reports]
    for proc in procs:
        proc.join(timeout=30)
    return got, statistics.median(token_times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama-3.1-8b")
    p.add_argument("--parts", default="1,2,4", help="splits to time, comma-separated (default: 1,2,4)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--processes", action="store_true",
                   help="also run each split with every part in a process of its own, chained by pipes")
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
    if args.processes:
        print("\nEach part in a process of its own (same device), chained by pipes:\n")
        print("| parts | each part's forward, ms (median) | sum, ms | token, ms (median) | token - sum, ms |")
        print("|---|---|---|---|---|")
        for parts in (int(x) for x in args.parts.split(",")):
            got, token = process_times(args.arch, parts, args.steps)
            total = sum(got) * 1e3
            print(f"| {parts} | {', '.join(f'{t * 1e3:.2f}' for t in got)} | {total:.2f} | {token * 1e3:.2f} "
                  f"| {token * 1e3 - total:+.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
