#!/usr/bin/env python3
"""The plan-file cluster against the simulator: tokens/s per stream with and without the WAN delays.

    .venv/bin/python scripts/bench_cluster.py --model kimi-k2-mini --fleet 2x4090,2x3090,2x3060 --regions 2 \
        --rtt-ms 1,60 --uplink-mbit 100 --rounds 3 --tokens 32

What it does, with progress on stderr:
1. `swarmd plan ... --out` writes the plan file (as a user would).
2. `swarmd run` (one process, no network) on the same prompt, `--rounds` times: this machine's decode speed on the
   model's own kernels.
3. `swarmd.cluster` brings the plan's fleet up in a fresh cluster directory (the code `swarmd cluster up` runs) and
   times `cluster up` to ready; one request compiles the kernels.
4. Rounds of one request with the emulated WAN at the plan's delays, then one with none (bandwidth kept), in turns
   (the order alternates from round to round): decode tokens/s per stream from the head's timings.
5. `planner.simulate` replays the bound plan over the daemons' own descriptors, every slot with this machine's
   measured device speed (the labels are names only), the emulator's links as its link model: a slot of another
   region is half the round trip away plus the uplink, one of the same region only the per-message cost. Two
   predictions: "micro-benchmark" takes the rates the daemons measured at start as they are; "model-calibrated"
   scales them once so that one node holding the whole model decodes as fast as `swarmd run` did here.
Results as Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import NodeDescriptor, Plan, PlanOptions, make_plan  # noqa: E402
from planner.plan_file import Fleet, PlanFile  # noqa: E402
from planner.simulate import SimConfig, percent_error, simulate  # noqa: E402
from swarmd.cluster.bringup import Cluster  # noqa: E402

PROMPT = "The capital of France is"


def say(line: str) -> None:
    print(f"[bench-cluster] {line}", file=sys.stderr, flush=True)


class EmulatedLinks:
    """The cluster's links as the simulator sees them: across regions half the round trip and the uplink, inside a
    region nothing but the per-message software cost (loopback)."""

    def __init__(self, fleet: Fleet, slot_of: dict[str, str], hop_ms: float, wan: bool) -> None:
        self.fleet, self.slot_of, self.hop_ms, self.wan = fleet, slot_of, hop_ms, wan

    def _across(self, src: str, dst: str) -> bool:
        return self.fleet.slot(self.slot_of[src]).region != self.fleet.slot(self.slot_of[dst]).region

    def latency_ms(self, src: str, dst: str) -> float:
        across = self._across(src, dst)
        return self.hop_ms + (self.fleet.rtt_between(self.slot_of[src], self.slot_of[dst]) / 2 if across and self.wan
                              else 0.0)

    def transfer_ms(self, src: str, dst: str, nbytes: int) -> float:
        return nbytes * 8 / (self.fleet.uplink_mbit * 1e6) * 1e3 if self._across(src, dst) else 0.0


def run_alone(model: str, tokens: int, env: dict[str, str]) -> float:
    """`swarmd run`'s decode tokens/s (from its stderr summary)."""
    done = subprocess.run([sys.executable, "-m", "swarmd", "run", "--model", model, "--max-tokens", str(tokens),
                           PROMPT], capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"swarmd run failed: {done.stderr[-500:]}")
    m = re.search(r"decode ([\d.]+) tok/s", done.stderr)
    assert m is not None, done.stderr
    return float(m.group(1))


def predict(plan: Plan, file: PlanFile, nodes: list[NodeDescriptor], layout: Any, slot_of: dict[str, str],
            prompt_tokens: int, tokens: int, wan: bool, scale: float, hop_ms: float) -> float:
    scaled = [replace(n, flops=n.flops * scale, mem_bandwidth=n.mem_bandwidth * scale) for n in nodes]
    config = SimConfig(streams=1, prompt_tokens=prompt_tokens, decode_tokens=tokens, hop_overhead_ms=hop_ms)
    return simulate(plan, layout, scaled, config, EmulatedLinks(file.fleet, slot_of, hop_ms, wan)).stream_tokens_per_s


def alone_ms(layout: Any, node: NodeDescriptor, prompt_tokens: int, tokens: int) -> float:
    """The simulator's ms per decoded token for one node holding the whole model (no network)."""
    plan = make_plan(layout, [node], options=PlanOptions(expert_placement="local"))
    result = simulate(plan, layout, [node], SimConfig(streams=1, prompt_tokens=prompt_tokens, decode_tokens=tokens))
    return 1e3 / result.stream_tokens_per_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="kimi-k2-mini")
    p.add_argument("--fleet", default="2x4090,2x3090,2x3060")
    p.add_argument("--regions", type=int, default=2)
    p.add_argument("--rtt-ms", default="1,60")
    p.add_argument("--uplink-mbit", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hop-ms", type=float, default=1.0, help="the simulator's per-message software cost (default 1)")
    args = p.parse_args()

    from models.gguf.header import read_header
    from models.text.tokenizer import Tokenizer
    from swarmd.daemon.served_model import served_model

    base = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    env = {**os.environ, "SWARMD_HOME": str(base / "home")}
    plan_path = base / "plan.json"
    cmd = [sys.executable, "-m", "swarmd", "plan", "--model", args.model, "--fleet", args.fleet, "--regions",
           str(args.regions), "--rtt-ms", args.rtt_ms, "--uplink-mbit", str(args.uplink_mbit), "--out", str(plan_path)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    file = PlanFile.loads(plan_path.read_text())
    model = served_model(args.model)
    assert model.path is not None
    prompt_tokens = len(Tokenizer(read_header(model.path).kv).encode(PROMPT))

    say(f"swarmd run x {args.rounds}: this machine's decode speed on {args.model}")
    run_alone(args.model, args.tokens, env)  # compiles (or finds) the kernels
    alone = [run_alone(args.model, args.tokens, env) for _ in range(args.rounds)]
    say(f"swarmd run: {', '.join(f'{x:.2f}' for x in alone)} tok/s")

    cluster = Cluster(plan_path, base / "home" / "cluster", say)
    measured: dict[bool, list[float]] = {True: [], False: []}
    try:
        cluster.start()
        status = cluster.wait_ready(600)
        ready_s = time.monotonic() - cluster.started_at
        say(f"ready {ready_s:.1f} s after cluster up; a first request compiles the kernels")
        body = {"prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0.0}
        cluster.generate(body)
        for r in range(args.rounds):
            for wan in ((True, False) if r % 2 == 0 else (False, True)):
                cluster.set_wan(wan)
                rate = cluster.generate(body)["timings"]["decode_tokens_per_s"]
                measured[wan].append(rate)
                say(f"round {r + 1}, WAN {'on' if wan else 'off'}: {rate:.2f} tok/s")
        bound = Plan.from_json(status["plan"])
        members = {m["peer_id"]: m for m in status["members"]}
        peers = status["slots"]["bound"]
    finally:
        cluster.stop()

    slot_of = {peer: slot for slot, peer in peers.items()}
    nodes = [NodeDescriptor(peer_id=p, memory_total=m["memory_total"], memory_free=m["memory_free"],
                            flops=m["flops"], mem_bandwidth=m["mem_bandwidth"], uplink_bps=args.uplink_mbit * 1e6)
             for p, m in members.items() if p in slot_of]
    layout = model.layout
    alone_tok_s = statistics.median(alone)
    scale = alone_ms(layout, nodes[0], prompt_tokens, args.tokens) / (1e3 / alone_tok_s)
    rows = []
    for wan in (True, False):
        got = statistics.median(measured[wan])
        sims = [predict(bound, file, nodes, layout, slot_of, prompt_tokens, args.tokens, wan, s, args.hop_ms)
                for s in (1.0, scale)]
        rows.append((wan, got, measured[wan], sims))

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"Command: `.venv/bin/python scripts/bench_cluster.py --model {args.model} --fleet {args.fleet} "
          f"--regions {args.regions} --rtt-ms {args.rtt_ms} --uplink-mbit {args.uplink_mbit:g} --rounds {args.rounds} "
          f"--tokens {args.tokens}`  ")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; {load}  ")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    print(f"`cluster up` to ready: {ready_s:.1f} s (fresh cluster directory). `swarmd run` alone: "
          f"{alone_tok_s:.2f} tok/s ({', '.join(f'{x:.2f}' for x in alone)}). Descriptor rates: "
          f"{nodes[0].flops / 1e9:.1f} GFLOP/s, {nodes[0].mem_bandwidth / 1e9:.1f} GB/s; model-calibrated scale "
          f"{scale:.3f}.\n")
    print("| WAN | measured tok/s per stream (rounds) | simulated, micro-benchmark | error | simulated, "
          "model-calibrated | error |")
    print("|---|---|---|---|---|---|")
    for wan, got, rounds, (raw, cal) in rows:
        print(f"| {'plan delays' if wan else 'none'} | {got:.2f} ({', '.join(f'{x:.2f}' for x in rounds)}) | "
              f"{raw:.2f} | {percent_error(raw, got):+.0f} % | {cal:.2f} | {percent_error(cal, got):+.0f} % |")
    (_, on, _, (raw_on, cal_on)), (_, off, _, (raw_off, cal_off)) = rows
    print(f"\nWhat the WAN adds per token: measured {1e3 / on - 1e3 / off:.1f} ms; simulated {1e3 / raw_on - 1e3 / raw_off:.1f}"
          f" ms (micro-benchmark), {1e3 / cal_on - 1e3 / cal_off:.1f} ms (model-calibrated).")
    print("\n" + json.dumps({"ready_s": ready_s, "alone": alone, "measured": {str(k): v for k, v in measured.items()},
                             "scale": scale}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
