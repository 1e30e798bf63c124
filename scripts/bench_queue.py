#!/usr/bin/env python3
"""Requests at once: aggregate tokens/s and time to first token for 1, 4, 16 and 64 requests sent together.

    .venv/bin/python scripts/bench_queue.py --rounds 3 --tokens 16 --baseline /path/to/a/checkout/of/main

* Swarms on loopback, started once: "4" (four `swarmd join` processes, an even plan file) and "1" (one daemon
  holding the whole model: `swarmd run` has no HTTP API and no queue, so the daemon with one stage stands for
  one process). With `--baseline DIR`, the same two again running the code in DIR ("4 (baseline)", "1
  (baseline)"): the code before the change, side by side, in the same rounds.
* Each measurement sends N greedy requests at once through `/v1/completions` (streamed, with usage), each
  with its own prompt, from N client threads. Aggregate tokens/s: completion tokens of all N / wall time from
  the first request sent to the last one done. Time to first token: per request, request sent -> first text
  chunk, as the client sees it (its wait in the queue included); p50 and p99 over every request of every
  round. Requests answered with an HTTP error are counted (a baseline daemon holds 4 requests and refuses
  the others with 503).
* Rounds interleave the swarms (round r: N = 1 on each swarm, then N = 4 on each, ...); every daemon runs with
  `--warmup` and after one warm-up round (kernel compiles and graph captures are not measured). The single-request cost
  of the change is N = 1 on this code against its baseline: ratios of medians.

Results go to stdout as a Markdown section for docs/BENCHMARKS.md (and as JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pipeline import start_swarm  # noqa: E402
from local_swarm import LocalSwarm, say  # noqa: E402

SUBJECTS = ("Paris", "the sea", "a violin", "Python", "the moon", "bread", "a river", "winter")
BASELINE = " (baseline)"


def prompt(i: int) -> str:
    return f"Request {i}. Write one sentence about {SUBJECTS[i % len(SUBJECTS)]}:"


def one_request(api: str, i: int, tokens: int, sent: float) -> dict[str, Any]:
    """One streamed greedy completion: status, time to first text chunk, completion tokens, when it ended."""
    body = {"model": "smollm2-135m", "prompt": prompt(i), "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first, completion = None, 0
    with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=httpx.Timeout(30, read=900)) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "ttft": None, "tokens": 0, "done": time.perf_counter()}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 500, "ttft": None, "tokens": 0, "done": time.perf_counter()}
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
            if chunk.get("usage"):
                completion = chunk["usage"]["completion_tokens"]
    return {"status": 200, "ttft": None if first is None else first - sent, "tokens": completion,
            "done": time.perf_counter()}


def at_once(api: str, n: int, tokens: int, offset: int) -> dict[str, Any]:
    """N requests sent together; aggregate tokens/s, each request's time to first token, refusals."""
    with ThreadPoolExecutor(n) as pool:
        sent = time.perf_counter()
        results = list(pool.map(lambda i: one_request(api, offset + i, tokens, sent), range(n)))
    ok = [r for r in results if r["status"] == 200]
    wall = max(r["done"] for r in results) - sent
    return {"tok_s": sum(r["tokens"] for r in ok) / wall, "ttft": [r["ttft"] for r in ok if r["ttft"] is not None],
            "errors": {str(s): sum(1 for r in results if r["status"] == s) for s in {r["status"] for r in results}
                       if s != 200}}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per request (default: 16)")
    parser.add_argument("--counts", default="1,4,16,64", help="requests at once (default: 1,4,16,64)")
    parser.add_argument("--context", type=int, default=512, help="--max-context of every daemon (default: 512)")
    parser.add_argument("--max-requests", type=int, default=32, help="--max-requests of this code's daemons")
    parser.add_argument("--baseline", type=Path, help="also measure swarms running the code in this checkout")
    parser.add_argument("--baseline-counts", default="1,4", help="counts measured on the baseline (default: 1,4)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    base_counts = [int(c) for c in args.baseline_counts.split(",")]

    swarms: dict[str, LocalSwarm] = {}
    try:
        warm = {"extra_of": lambda i: ("--warmup",)}  # every batch size's graph captured before the stage is ready
        for n in (4, 1):
            swarms[str(n)] = start_swarm(n, args.context, args.max_requests, name=f"queue{n}", **warm)
            if args.baseline:
                env = {"PYTHONPATH": str(args.baseline.resolve()), "PYTHONSAFEPATH": "1"}  # not the working dir
                swarms[f"{n}{BASELINE}"] = start_swarm(n, args.context, 4, name=f"queue{n}b",
                                                       env_of=lambda i, e=env: e, **warm)
        plan = {name: (counts if not name.endswith(BASELINE) else base_counts) for name in swarms}
        say("warm-up: every count once on every swarm (compiles, graph captures)")
        for name, swarm in swarms.items():
            for n in plan[name]:
                at_once(swarm.api, n, args.tokens, 1000)
        results: dict[str, dict[int, list[dict[str, Any]]]] = {name: {n: [] for n in plan[name]} for name in swarms}
        for r in range(args.rounds):
            for n in counts:
                for name, swarm in swarms.items():
                    if n in plan[name]:
                        got = at_once(swarm.api, n, args.tokens, 0)
                        results[name][n].append(got)
                        say(f"round {r + 1}: {name}, {n} at once: {got['tok_s']:.1f} tok/s, ttft p50 "
                            f"{statistics.median(got['ttft']) if got['ttft'] else float('nan'):.3f} s, "
                            f"errors {got['errors']}")
    finally:
        for swarm in swarms.values():
            swarm.stop()

    table = []
    for name, by_n in results.items():
        for n, rounds in by_n.items():
            ttft = [t for got in rounds for t in got["ttft"]]
            errors: dict[str, int] = {}
            for got in rounds:
                for k, v in got["errors"].items():
                    errors[k] = errors.get(k, 0) + v
            table.append({"swarm": name, "n": n, "tok_s": statistics.median(g["tok_s"] for g in rounds),
                          "ttft_p50": percentile(ttft, 0.5) if ttft else None,
                          "ttft_p99": percentile(ttft, 0.99) if ttft else None, "errors": errors,
                          "rounds": [round(g["tok_s"], 2) for g in rounds]})
    if args.json:
        print(json.dumps(table, indent=1))
    command = (f"scripts/bench_queue.py --rounds {args.rounds} --tokens {args.tokens} --counts {args.counts} "
               f"--context {args.context} --max-requests {args.max_requests}"
               + (f" --baseline {args.baseline}" if args.baseline else ""))
    print(f"`{command}` on {platform.node()} ({platform.processor() or platform.machine()}), "
          f"{time.strftime('%Y-%m-%d')}; {args.tokens} tokens per request, medians of {args.rounds} rounds.\n")
    print("| swarm | requests at once | aggregate tok/s | TTFT p50 (s) | TTFT p99 (s) | refused | tok/s per round |")
    print("|---|---|---|---|---|---|---|")
    for row in table:
        p50 = "-" if row["ttft_p50"] is None else f"{row['ttft_p50']:.3f}"
        p99 = "-" if row["ttft_p99"] is None else f"{row['ttft_p99']:.3f}"
        refused = ", ".join(f"{v} x {k}" for k, v in row["errors"].items()) or "0"
        print(f"| {row['swarm']} | {row['n']} | {row['tok_s']:.2f} | {p50} | {p99} | {refused} | {row['rounds']} |")
    if args.baseline:
        print()
        for n in ("4", "1"):
            mine = next(r for r in table if r["swarm"] == n and r["n"] == 1)
            base = next(r for r in table if r["swarm"] == f"{n}{BASELINE}" and r["n"] == 1)
            print(f"One request alone on {n} daemon{'s' if n != '1' else ''}: this code / baseline = "
                  f"{mine['tok_s'] / base['tok_s']:.3f} (tokens/s), {mine['ttft_p50'] / base['ttft_p50']:.3f} (TTFT p50)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
