#!/usr/bin/env python3
"""What an idle swarm costs: the CPU of each `swarmd join` process of a ready swarm that serves nothing.

    .venv/bin/python scripts/bench_idle.py --daemons 4 --seconds 60
    .venv/bin/python scripts/bench_idle.py --baseline ../old   # and a swarm running another checkout's code

Starts a local swarm (`scripts/local_swarm.py`, SmolLM2-135M, default timings), and with `--baseline DIR` a second
one whose daemons run DIR's code, waits until each is ready, lets them settle, then reads every daemon's CPU seconds
(user + system) over the same `--seconds` for both. Prints each daemon's share of a core and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from local_swarm import LocalSwarm, say  # noqa: E402


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--daemons", type=int, default=4)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--settle", type=float, default=15.0, help="seconds between ready and the first reading")
    ap.add_argument("--timings", default="lan")
    ap.add_argument("--baseline", type=Path, help="also a swarm running the code of this checkout")
    args = ap.parse_args()

    swarms = {"this code": LocalSwarm(args.daemons, model=args.model, swarm="idle", timings=args.timings)}
    if args.baseline:
        env = {"PYTHONPATH": str(args.baseline.resolve()), "PYTHONSAFEPATH": "1"}
        swarms["baseline"] = LocalSwarm(args.daemons, model=args.model, swarm="idlebase", timings=args.timings,
                                        env_of=lambda i: env)
    try:
        for sw in swarms.values():
            sw.start()
            sw.wait_ready()
        time.sleep(args.settle)
        before = {name: [cpu_seconds(d.proc.pid) for d in sw.daemons] for name, sw in swarms.items()}
        started = time.monotonic()
        time.sleep(args.seconds)
        took = time.monotonic() - started
        after = {name: [cpu_seconds(d.proc.pid) for d in sw.daemons] for name, sw in swarms.items()}
    finally:
        for sw in swarms.values():
            sw.stop()
    say(f"{args.daemons} idle daemons per swarm, {took:.0f} s, timings {args.timings}")
    print("| swarm | % of a core per daemon | median |")
    print("|---|---|---|")
    for name in swarms:
        shares = [100 * (a - b) / took for a, b in zip(after[name], before[name], strict=True)]
        print(f"| {name} | {', '.join(f'{s:.1f}' for s in shares)} | {statistics.median(shares):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
