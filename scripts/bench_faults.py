#!/usr/bin/env python3
"""Fault-tolerance figures: recovery from `kill -9` of a stage, split into its parts, and the cost of resets.

    .venv/bin/python scripts/bench_faults.py --daemons 3 --tokens 32
    .venv/bin/python scripts/bench_faults.py --skip-kill --reset-rates 0,0.01,0.05

Starts a swarm of real daemons on loopback, each behind an emulated link (`scripts/link_emulator.py`), serving
SmolLM2 (the kernel cache is warm after the first request). Then:

* recovery: a greedy request through the leader; after `--kill-after` tokens a stage that is neither the head
  nor the leader gets `kill -9`. From the daemons' logs and the head's own record of the move:
  detection (kill -> the leader marks the member dead), re-plan (-> the head has the new plan), weight loading
  (the slowest stage that loaded blocks for that plan), replay (the head sends the token history to the new
  chain -> the next token: kernel compilation, with a warm cache only lookups, and the KV rebuild), the total
  (kill -> the next token), and tokens lost (streamed tokens that differ from the undisturbed run's, or repeat).
* resets (on the daemons left after the kill): the same request with each link resetting every forwarded chunk
  with probability p; decode tokens/s side by side with p = 0 (medians of `--repeats` runs), frames the
  transports resent, and runs whose tokens differed or that failed.

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults.fault_swarm import FaultSwarm  # noqa: E402

PROMPT = "The history of the printing press begins in"
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def say(line: str) -> None:
    print(f"[bench-faults] {line}", file=sys.stderr, flush=True)


def log_time(line: str) -> float | None:
    m = STAMP.match(line)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_line(path: Path, pattern: str, after: float) -> tuple[float, str] | None:
    for line in path.read_text(errors="replace").splitlines():
        t = log_time(line)
        if t is not None and t >= after - 0.002 and re.search(pattern, line):
            return t, line
    return None


def recovery(swarm: FaultSwarm, tokens: int, kill_after: int) -> dict[str, Any]:
    status = swarm.running[0].status()
    leader = status["leader"]
    head = swarm.index_of(leader)
    stages = [s["peer_id"] for s in status["plan"]["stages"]]
    victim = next(swarm.index_of(p) for p in stages if p != leader)
    expected, _ = swarm.stream(head, prompt=PROMPT, max_tokens=tokens)
    killed: dict[str, float] = {}

    def kill(n: int) -> None:
        if n == kill_after:
            killed["wall"], killed["perf"] = time.time(), time.perf_counter()
            swarm.daemons[victim].kill9()

    arrivals: list[float] = []

    def on_token(n: int) -> None:
        arrivals.append(time.perf_counter())
        kill(n)

    pairs, end = swarm.stream(head, prompt=PROMPT, max_tokens=tokens, on_token=on_token)
    if end["event"] != "done":
        raise RuntimeError(f"the request failed: {end}")
    short = swarm.peers[victim][-6:]
    leader_log = swarm.daemons[head].log_path
    dead = first_line(leader_log, rf"member {short}: .*-> dead", killed["wall"])
    planned = first_line(leader_log, r"plan epoch \d+ from", killed["wall"])
    loads = []
    for i in range(len(swarm.daemons)):
        if i == victim:
            continue
        for line in swarm.daemons[i].log_path.read_text(errors="replace").splitlines():
            t = log_time(line)
            m = re.search(r"ready: blocks \d+-\d+ loaded in ([\d.]+) s", line)
            if m and t is not None and t >= killed["wall"]:
                loads.append(float(m.group(1)))
    rec = end.get("recoveries", [{}])[0]
    after_kill = [t for t in arrivals if t > killed["perf"]]
    return {
        "daemons": len(swarm.daemons), "tokens": tokens, "killed_after_token": kill_after,
        "detection_s": round(dead[0] - killed["wall"], 3) if dead else None,
        "replan_s": round(planned[0] - dead[0], 3) if dead and planned else None,
        "weight_loading_s": max(loads) if loads else 0.0,
        "wait_for_chain_s": rec.get("wait_for_chain_s"),
        "replay_compile_and_kv_rebuild_s": rec.get("replay_s"),
        "replayed_tokens": rec.get("replayed_tokens"),
        "kill_to_next_token_s": round(after_kill[0] - killed["perf"], 3) if after_kill else None,
        "tokens_lost": sum(1 for a, b in zip(pairs, expected, strict=False) if a != b) + abs(len(pairs) - len(expected)),
        "same_tokens": pairs == expected,
    }


def decode_rate(swarm: FaultSwarm, tokens: int, via: int) -> tuple[float, bool, list[tuple[int, int]]]:
    arrivals: list[float] = []
    pairs, end = swarm.stream(via, prompt=PROMPT, max_tokens=tokens, on_token=lambda n: arrivals.append(time.perf_counter()))
    ok = end["event"] == "done"
    rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 0.0
    return rate, ok, pairs


def resets(swarm: FaultSwarm, tokens: int, rates: list[float], repeats: int) -> dict[str, Any]:
    expected, _ = swarm.stream(0, prompt=PROMPT, max_tokens=tokens)
    out: dict[str, Any] = {}
    samples: dict[float, list[float]] = {p: [] for p in rates}
    wrong: dict[float, int] = {p: 0 for p in rates}
    resent: dict[float, int] = {p: 0 for p in rates}
    for _ in range(repeats):
        for p in rates:  # side by side: each rate once per round
            for name in swarm.links.ports:
                swarm.links.set(name, reset_probability=p)
            before = sum(swarm.pipeline(i)["transport"]["resent"] for i in range(len(swarm.running)))
            try:
                rate, ok, pairs = decode_rate(swarm, tokens, 0)
            except Exception as e:  # the stream broke: counted as a failed run
                say(f"p = {p}: {type(e).__name__}: {e}")
                rate, ok, pairs = 0.0, False, []
            finally:
                for name in swarm.links.ports:
                    swarm.links.set(name, reset_probability=0.0)
            resent[p] += sum(swarm.pipeline(i)["transport"]["resent"] for i in range(len(swarm.running))) - before
            samples[p].append(rate)
            wrong[p] += not ok or pairs != expected
    base = statistics.median(samples[rates[0]])
    for p in rates:
        med = statistics.median(samples[p])
        out[str(p)] = {"decode_tok_s_median": round(med, 2), "vs_no_resets": round(med / base, 3) if base else None,
                       "runs": repeats, "runs_with_other_tokens_or_errors": wrong[p], "frames_resent": resent[p]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--daemons", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--kill-after", type=int, default=8)
    p.add_argument("--reset-rates", default="0,0.01,0.05")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-kill", action="store_true")
    p.add_argument("--skip-resets", action="store_true")
    args = p.parse_args()
    results: dict[str, Any] = {"command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="swarmd-faults-") as tmp:
        base = Path(tmp)
        from swarmd.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

        device = resolve_device("auto")
        load_or_measure(base, device, device_name(device))
        swarm = FaultSwarm(base / "swarm", base / BENCH_FILE, args.daemons, extra=("--max-context", "256"))
        try:
            say(f"starting {args.daemons} daemons")
            swarm.start()
            swarm.stream(0, prompt=PROMPT, max_tokens=4)  # warm every stage's kernels
            if not args.skip_kill:
                say("kill -9 of a stage")
                results["recovery"] = recovery(swarm, args.tokens, args.kill_after)
                say(json.dumps(results["recovery"]))
            if not args.skip_resets:  # on the daemons left; the highest rate last (it may split the swarm)
                swarm.wait_chain(len(swarm.running), 300)
                say(f"resets over {len(swarm.running)} daemons")
                results["resets"] = resets(swarm, args.tokens, [float(x) for x in args.reset_rates.split(",")],
                                           args.repeats)
        finally:
            swarm.stop()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
