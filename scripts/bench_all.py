#!/usr/bin/env python3
"""Run the benchmark suite and write one Markdown report.

    .venv/bin/python scripts/bench_all.py --out bench-report.md            # everything (about an hour here)
    .venv/bin/python scripts/bench_all.py --only pipeline,wan --quick      # fewer rounds and tokens

Each benchmark runs as its own process, one after the other (they would disturb each other's timings), and
prints a Markdown section; the report collects them with the command line, the machine and the date:

    pipeline   scripts/bench_pipeline.py  single process vs N = 2, 4 on loopback: decode and prefill tok/s,
                                          per-hop cost against raw TCP, requests at once
    hop        scripts/bench_hop.py       per-hop cost of the actor transport vs raw TCP / TLS by payload size
    trace      scripts/bench_trace.py     tracing off vs on (interleaved), the per-token breakdown and its PNG
    wan        scripts/bench_wan.py       N = 2, 4 behind the link emulator (10 ms one way, 100 Mbit/s) against
                                          1 / (compute + N x (delay + loopback hop)), 8 requests at once

A benchmark that fails is reported with its exit code and the end of its stderr; the others still run.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# name -> (title, arguments, quick arguments)
SUITE: dict[str, tuple[str, list[str], list[str]]] = {
    "pipeline": ("Pipeline on loopback: single process vs N = 2, 4",
                 ["scripts/bench_pipeline.py", "--rounds", "4", "--tokens", "48"],
                 ["scripts/bench_pipeline.py", "--rounds", "2", "--tokens", "24"]),
    "hop": ("Per-hop cost against raw TCP",
            ["scripts/bench_hop.py", "latency", "--rounds", "5", "--batch", "40"],
            ["scripts/bench_hop.py", "latency", "--rounds", "2", "--batch", "20"]),
    "trace": ("Tracing overhead and the per-token breakdown",
              ["scripts/bench_trace.py", "--rounds", "8", "--tokens", "48", "--plot", "docs/img/token-breakdown.png"],
              ["scripts/bench_trace.py", "--rounds", "4", "--tokens", "24", "--plot", "docs/img/token-breakdown.png"]),
    "wan": ("WAN: 10 ms one way, 100 Mbit/s per link",
            ["scripts/bench_wan.py", "--daemons", "2,4", "--rounds", "3", "--tokens", "32"],
            ["scripts/bench_wan.py", "--daemons", "2,4", "--rounds", "1", "--tokens", "16"]),
}


def run(name: str, quick: bool) -> str:
    title, full, short = SUITE[name]
    cmd = [PY, *(short if quick else full)]
    print(f"[bench-all] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - start
    head = f"## {title}\n\n`{' '.join(['.venv/bin/python', *cmd[1:]])}` ({took / 60:.1f} min)\n\n"
    if done.returncode != 0:
        return head + f"**Failed** (exit code {done.returncode}):\n\n```\n{done.stderr[-3000:]}\n```\n"
    return head + done.stdout.strip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-report.md"), help="the report (Markdown)")
    parser.add_argument("--only", default=",".join(SUITE), help=f"comma-separated among {', '.join(SUITE)}")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and tokens (a smoke run)")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose among {list(SUITE)}")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    parts = [f"# swarmd benchmark report\n\nCommand: `.venv/bin/python scripts/bench_all.py --only {','.join(names)}"
             f"{' --quick' if args.quick else ''}`  \nMachine: {platform.machine()}, {platform.processor() or ''} "
             f"Python {platform.python_version()}; at the start: {load}  \n"
             f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n"]
    for name in names:
        parts.append(run(name, args.quick))
        args.out.write_text("\n".join(parts))  # a partial report survives an interrupted run
    print(f"[bench-all] report written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
