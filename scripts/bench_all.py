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
    moe        scripts/bench_moe.py       expert parallelism on 4 daemons: fan-out per MoE layer against a hop,
                                          messages per token, decode tok/s against one process, expert load

Each benchmark's own progress lines (its stderr) show as it runs, and each has a time limit (`--limit-min`
scales them): one that fails or runs over is reported with its exit code and the end of its stderr, its
process group (its daemons included) is stopped, and the others still run.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# name -> (title, arguments, quick arguments, time limit in minutes at --limit-min 1)
SUITE: dict[str, tuple[str, list[str], list[str], float]] = {
    "pipeline": ("Pipeline on loopback: single process vs N = 2, 4",
                 ["scripts/bench_pipeline.py", "--rounds", "4", "--tokens", "48"],
                 ["scripts/bench_pipeline.py", "--rounds", "2", "--tokens", "24"], 25),
    "hop": ("Per-hop cost against raw TCP",
            ["scripts/bench_hop.py", "latency", "--markdown", "--rounds", "5", "--batch", "40"],
            ["scripts/bench_hop.py", "latency", "--markdown", "--rounds", "2", "--batch", "20"], 10),
    "trace": ("Tracing overhead and the per-token breakdown",
              ["scripts/bench_trace.py", "--rounds", "8", "--tokens", "48", "--plot", "docs/img/token-breakdown.png"],
              ["scripts/bench_trace.py", "--rounds", "4", "--tokens", "24", "--plot", "docs/img/token-breakdown.png"],
              25),
    "wan": ("WAN: 10 ms one way, 100 Mbit/s per link",
            ["scripts/bench_wan.py", "--daemons", "2,4", "--rounds", "3", "--tokens", "32"],
            ["scripts/bench_wan.py", "--daemons", "2,4", "--rounds", "1", "--tokens", "16"], 35),
    "moe": ("Expert parallelism: MoE fan-out on loopback",
            ["scripts/bench_moe.py", "--rounds", "3", "--tokens", "32"],
            ["scripts/bench_moe.py", "--rounds", "1", "--tokens", "16", "--balance-tokens", "8"], 25),
}


def run(name: str, quick: bool, limit_scale: float) -> str:
    title, full, short, limit_min = SUITE[name]
    limit = limit_min * limit_scale * 60
    cmd = [PY, *(short if quick else full)]
    say(f"{name}: {' '.join(cmd[1:])} (limit {limit / 60:.0f} min)")
    start = time.monotonic()
    code, stdout, stderr_tail = _run_bounded(cmd, limit)
    took = time.monotonic() - start
    say(f"{name}: {'done' if code == 0 else f'exit code {code}'} in {took / 60:.1f} min")
    head = f"## {title}\n\n`{' '.join(['.venv/bin/python', *cmd[1:]])}` ({took / 60:.1f} min)\n\n"
    if code is None:
        return head + f"**Stopped after its limit of {limit / 60:.0f} min**:\n\n```\n{stderr_tail}\n```\n"
    if code != 0:
        return head + f"**Failed** (exit code {code}):\n\n```\n{stderr_tail}\n```\n"
    return head + stdout.strip() + "\n"


def _run_bounded(cmd: list[str], limit: float) -> tuple[int | None, str, str]:
    """Run `cmd` in a process group of its own, its stderr shown as it comes and kept for the report:
    (exit code, or None when it ran past `limit` s and was stopped with its daemons; stdout; stderr's end)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True, start_new_session=True)
        tee = threading.Thread(target=_tee, args=(proc.stderr, err), daemon=True)
        tee.start()
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            code = None
        tee.join(10)
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()[-3000:]


def _tee(stream: TextIO, copy: TextIO) -> None:
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        copy.write(line)


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGINT to the benchmark (its own clean-up stops its daemons), then SIGTERM and SIGKILL to its whole
    process group (daemons and link emulator included) while anything is left."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGINT:  # the benchmark is gone: end what it left behind in its group
            continue
        return


def say(line: str) -> None:
    print(f"[bench-all {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-report.md"), help="the report (Markdown)")
    parser.add_argument("--only", default=",".join(SUITE), help=f"comma-separated among {', '.join(SUITE)}")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and tokens (a smoke run)")
    parser.add_argument("--limit-min", type=float, default=1.0,
                        help="scale every benchmark's time limit (default 1: 25, 10, 25, 35 min)")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose among {list(SUITE)}")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    parts = [f"# swarmd benchmark report\n\nCommand: `.venv/bin/python scripts/bench_all.py --only {','.join(names)}"
             f"{' --quick' if args.quick else ''}`  \nMachine: {platform.machine()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}; at the start: {load}  \n"
             f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n"]
    for name in names:
        parts.append(run(name, args.quick, args.limit_min))
        args.out.write_text("\n".join(parts))  # a partial report survives an interrupted run
    say(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
