#!/usr/bin/env python3
"""As a user sees it: `swarmd submit-prompt` against a local swarm, against `swarmd run`, for one greedy prompt.

    .venv/bin/python scripts/bench_submit.py --rounds 5 --tokens 64
    .venv/bin/python scripts/bench_submit.py --model synthetic-moe-small --expert-placement spread --min-holders 3

Starts N `swarmd join` daemons on loopback as a user would (no plan file: the leader plans), waits until the
leader's plan gives every daemon work (for a MoE model, routed experts on at least `--min-holders` daemons)
and the chain is ready, then runs `swarmd run --model M` and `swarmd submit-prompt --api ...` in turn, each
round in the other order, after one warm-up of each (kernels compile, graphs are captured). Both print
"decode X tok/s" on stderr; the medians and their ratio are printed as a Markdown section. `--baseline DIR`
runs the daemons with the code of another checkout (DIR), for a comparison with the code before.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from local_swarm import LocalSwarm, http, say  # noqa: E402

PROMPT = "Once upon a time, in a small village at the edge of the forest,"
DECODE = re.compile(r"decode ([0-9.]+) tok/s")
TOKENS = re.compile(r"(\d+) tokens")


def wait_for_work(swarm: LocalSwarm, min_holders: int, timeout: float = 300.0) -> dict:
    """The plan once every daemon has work, experts (if any) are on `min_holders` daemons and the chain is ready."""
    deadline = time.monotonic() + timeout
    said = ""
    while time.monotonic() < deadline:
        try:
            plan = swarm.daemons[0].status()["plan"]
            ready = http.get(f"{swarm.api}/api/v0/pipeline", timeout=5).json()["chain"]["ready"]
        except (httpx.HTTPError, KeyError, ValueError):
            plan, ready = None, False
        if plan:
            holders = {p for by in plan["experts"].values() for hs in by.values() for p in hs}
            working = {s["peer_id"] for s in plan["stages"]} | holders
            detail = (f"plan epoch {plan['epoch']}: {len(plan['stages'])} stages, work on {len(working)} of "
                      f"{len(swarm.daemons)} daemons, experts on {len(holders)}, chain {'ready' if ready else 'loading'}")
            if ready and len(working) == len(swarm.daemons) and (not plan["experts"] or len(holders) >= min_holders):
                say(detail)
                return plan
            if detail != said:
                say(detail)
                said = detail
        time.sleep(1.0)
    raise RuntimeError(f"the swarm did not give every daemon work within {timeout:.0f} s: {said}")


def swarmd(*args: str, env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run a swarmd command; its decode tokens/s and completion tokens from its stderr line."""
    proc = subprocess.run([sys.executable, "-m", "swarmd", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})
    rate, count = DECODE.search(proc.stderr), TOKENS.findall(proc.stderr)
    if proc.returncode != 0 or rate is None:
        raise RuntimeError(f"swarmd {args[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return float(rate.group(1)), int(count[-1]) if count else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--daemons", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--expert-placement", default="auto")
    ap.add_argument("--min-holders", type=int, default=1, help="MoE: experts on at least this many daemons")
    ap.add_argument("--baseline", type=Path, help="run the daemons with the code of this checkout")
    ap.add_argument("--daemon-option", action="append", default=[], help="more `swarmd join` options")
    args = ap.parse_args()

    env_of = None
    if args.baseline:
        env = {"PYTHONPATH": str(args.baseline.resolve()), "PYTHONSAFEPATH": "1"}
        env_of = lambda i: env  # noqa: E731
    say(f"fetching {args.model} into the model cache if needed")
    subprocess.run([sys.executable, "-m", "swarmd", "pull", args.model], check=True, capture_output=True)
    swarm = LocalSwarm(args.daemons, model=args.model, swarm="benchsubmit", env_of=env_of,
                       extra=("--max-context", str(args.context), "--expert-placement", args.expert_placement,
                              *args.daemon_option))
    run_args = ("run", "--model", args.model, "--max-tokens", str(args.tokens), "--max-context", str(args.context),
                PROMPT)
    submit_args = ("submit-prompt", "--max-tokens", str(args.tokens), PROMPT)
    rates: dict[str, list[float]] = {"run": [], "submit": []}
    counts: dict[str, list[int]] = {"run": [], "submit": []}
    try:
        swarm.start()
        plan = wait_for_work(swarm, args.min_holders)
        submit = (*submit_args[:1], "--api", swarm.api, *submit_args[1:])
        say("warm-up: one request each")
        swarmd(*submit)
        swarmd(*run_args)
        for r in range(args.rounds):
            for kind in (("run", "submit") if r % 2 == 0 else ("submit", "run")):
                rate, count = swarmd(*(run_args if kind == "run" else submit))
                rates[kind].append(rate)
                counts[kind].append(count)
            say(f"round {r + 1}: run {rates['run'][-1]:.2f} tok/s, submit-prompt {rates['submit'][-1]:.2f} tok/s")
    finally:
        swarm.stop()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    run, sub = statistics.median(rates["run"]), statistics.median(rates["submit"])
    holders = {p for by in plan["experts"].values() for hs in by.values() for p in hs}
    print(f"Command: `.venv/bin/python scripts/bench_submit.py {' '.join(sys.argv[1:])}`  ")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; {load}  ")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    print(f"`{args.model}` on {args.daemons} daemons (plan epoch {plan['epoch']}: stages "
          f"{[s['layers'] for s in plan['stages']]}" + (f", routed experts on {len(holders)} daemons" if holders else "")
          + f"), {args.tokens}-token greedy prompt, {args.rounds} rounds interleaved:\n")
    print("| command | decode tok/s (median) | rounds | tokens |")
    print("|---|---|---|---|")
    for kind, name in (("run", "`swarmd run`"), ("submit", f"`swarmd submit-prompt`, {args.daemons} daemons")):
        print(f"| {name} | {statistics.median(rates[kind]):.2f} | {', '.join(f'{x:.2f}' for x in rates[kind])} | "
              f"{', '.join(map(str, counts[kind]))} |")
    ratios = [s / r for s, r in zip(rates["submit"], rates["run"], strict=True)]
    print(f"\nsubmit-prompt / run: **{sub / run:.3f}x** (ratio of the medians); per round "
          f"{', '.join(f'{x:.3f}' for x in ratios)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
