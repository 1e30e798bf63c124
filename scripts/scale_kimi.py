#!/usr/bin/env python3
"""Kimi-K2 at int4 over simulated fleets: the planner's plan, then the simulator's replay.

Prints the Markdown tables of docs/SCALE.md. Every fleet, network and software constant used is
defined here or in planner/fleet.py, and documented in docs/SCALE.md.

    .venv/bin/python scripts/scale_kimi.py            # all tables (a few minutes on 2 cores)
    .venv/bin/python scripts/scale_kimi.py --quick    # fewer simulated tokens
    .venv/bin/python scripts/scale_kimi.py --acceptance docs/data/spec_acceptance.json
    .venv/bin/python scripts/scale_kimi.py --hop-ms 0.25   # a measured per-message cost instead of 1.0 ms

The speculative rows use the acceptance measured by scripts/bench_spec.py (`--json`, kept in
docs/data/spec_acceptance.json): per mode, the drafts per pass and the chance a draft is accepted given the ones
before it were. Without the file they fall back to the assumptions (3 drafts at 70 %, 4 at 85 %).

    .venv/bin/python scripts/scale_kimi.py --block-ms 0.3 --block-gb 0.31 --peak-tbs 4.8
        # a measured Kimi-K2 block decode (0.3 ms for 0.31 GB read on a 4.8 TB/s GPU) in place of the assumed
        # 0.8 of peak bandwidth: every GPU is taken to reach the same fraction of its peak
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, replace

from planner import BUILTIN_ARCHS, PlanOptions, layout_from_arch, make_plan
from planner.fleet import make_fleet
from planner.simulate import SimConfig, simulate

# Round-trip times between eight cloud regions, in ms, rounded from commonly published
# inter-region measurements (an assumption, not a measurement made here):
# us-west, us-east, sa-east, eu-west, eu-central, ap-south, ap-southeast, ap-northeast.
REGIONS = ["us-west", "us-east", "sa-east", "eu-west", "eu-central", "ap-south", "ap-southeast", "ap-northeast"]
_PAIRS = {
    ("us-west", "us-east"): 65, ("us-west", "sa-east"): 175, ("us-west", "eu-west"): 140,
    ("us-west", "eu-central"): 150, ("us-west", "ap-south"): 220, ("us-west", "ap-southeast"): 170,
    ("us-west", "ap-northeast"): 105, ("us-east", "sa-east"): 115, ("us-east", "eu-west"): 75,
    ("us-east", "eu-central"): 90, ("us-east", "ap-south"): 190, ("us-east", "ap-southeast"): 215,
    ("us-east", "ap-northeast"): 150, ("sa-east", "eu-west"): 185, ("sa-east", "eu-central"): 200,
    ("sa-east", "ap-south"): 300, ("sa-east", "ap-southeast"): 320, ("sa-east", "ap-northeast"): 255,
    ("eu-west", "eu-central"): 20, ("eu-west", "ap-south"): 110, ("eu-west", "ap-southeast"): 160,
    ("eu-west", "ap-northeast"): 220, ("eu-central", "ap-south"): 110, ("eu-central", "ap-southeast"): 160,
    ("eu-central", "ap-northeast"): 230, ("ap-south", "ap-southeast"): 60, ("ap-south", "ap-northeast"): 120,
    ("ap-southeast", "ap-northeast"): 70,
}
# Two homes in the same region: two last miles and a metro network.
HOME_TO_HOME_RTT_MS = 15.0


def world_rtt() -> list[list[float]]:
    table = [[0.0] * len(REGIONS) for _ in REGIONS]
    for i, a in enumerate(REGIONS):
        for j, b in enumerate(REGIONS):
            table[i][j] = HOME_TO_HOME_RTT_MS if i == j else float(_PAIRS.get((a, b)) or _PAIRS[(b, a)])
    return table


@dataclass(frozen=True)
class Fleet:
    name: str
    spec: str
    regions: int = 1
    rtt_ms: tuple[float, float] = (1.0, 1.0)
    uplink_mbit: float = 1000.0
    region_rtt: list[list[float]] | None = field(default=None, hash=False)
    bandwidth_efficiency: float | None = None  # None: planner.fleet's assumed 0.8 of peak

    def nodes(self):
        return make_fleet(self.spec, regions=self.regions, rtt_ms=self.rtt_ms, uplink_mbit=self.uplink_mbit,
                          region_rtt_ms=self.region_rtt, bandwidth_efficiency=self.bandwidth_efficiency)


FLEETS = [
    Fleet("LAN cluster", "40x4090,8x3090,4x3060", rtt_ms=(0.5, 0.5), uplink_mbit=1000),
    Fleet("3 regional clusters", "60x4090,60x3090,30x4060ti", regions=3, rtt_ms=(5.0, 40.0), uplink_mbit=100),
    Fleet("global spread", "400x4090,300x3090,200x3060,100x4060ti", regions=8, uplink_mbit=50,
          region_rtt=world_rtt()),
    Fleet("5 Mac Studios", "5xm2ultra", rtt_ms=(0.5, 0.5), uplink_mbit=10000),
]

# What a faster transport would cost per message (a compiled framing/encryption path instead of
# py-libp2p's ~1 ms); an assumption for the "what it would take" rows.
FAST_HOP_MS = 0.1
# A small draft model on the first stage's GPU (about 1 ms per drafted token) whose tokens the
# chain accepts 70 % of the time; and a stronger one, like a multi-token-prediction head.
SPECULATIVE = dict(speculative_tokens=3, acceptance=0.7, draft_ms_per_token=1.0)
STRONG_DRAFT = dict(speculative_tokens=4, acceptance=0.85, draft_ms_per_token=1.0)
# Drafting by prompt lookup costs no model: a lookup in the request's own tokens.
NGRAM_DRAFT_MS = 0.0


def measured_drafts(path: str) -> list[tuple[str, dict]]:
    """(row label, SimConfig changes) per mode measured by scripts/bench_spec.py --json: the drafts per pass (the
    adaptive k's mean, rounded) and the per-token acceptance of its 10 ms rounds; a draft model is taken to cost
    1 ms per drafted token on stage 0's GPU, as in the assumed rows."""
    import json

    doc = json.loads(open(path).read())
    rows = []
    for r in doc["wan"]:
        if r["mode"] == "off" or not r.get("token_acceptance") or not r.get("drafted_per_pass"):
            continue
        k = max(1, round(r["drafted_per_pass"]))
        draft_ms = NGRAM_DRAFT_MS if r["mode"] == "ngram" else 1.0
        rows.append((f"+ speculation measured: {r['mode']} on {r['set']} ({k} draft{'s' if k > 1 else ''}, "
                     f"{100 * r['token_acceptance']:.0f} % accepted)",
                     dict(speculative_tokens=k, acceptance=r["token_acceptance"], draft_ms_per_token=draft_ms)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--acceptance", metavar="FILE", help="scripts/bench_spec.py --json output: measured drafts "
                        "and acceptance in place of the assumed 70 %% / 85 %%")
    parser.add_argument("--hop-ms", type=float, default=1.0,
                        help="software cost per message, ms (default 1.0: py-libp2p; see docs/BENCHMARKS.md)")

    parser.add_argument("--block-ms", type=float, help="measured decode time of one MoE block (batch 1)")
    parser.add_argument("--block-gb", type=float, help="the bytes that block's decode reads, in GB")
    parser.add_argument("--peak-tbs", type=float, help="peak bandwidth of the GPU it was measured on, TB/s")
    args = parser.parse_args()
    hop = args.hop_ms
    speculation = measured_drafts(args.acceptance) if args.acceptance else [
        ("+ speculative decoding (3 drafts, 70 % accepted)", SPECULATIVE),
        ("... or with 4 drafts, 85 % accepted", STRONG_DRAFT)]
    tokens = 8 if args.quick else 24
    fleets = FLEETS
    if args.block_ms:
        efficiency = args.block_gb / args.block_ms / args.peak_tbs  # GB/ms = TB/s
        print(f"bandwidth efficiency from the measured block: {efficiency:.3f} of peak (assumed before: 0.8)\n")
        fleets = [replace(f, bandwidth_efficiency=efficiency) for f in FLEETS]
    layout = layout_from_arch(BUILTIN_ARCHS["kimi-k2"], "int4")
    t0 = time.time()
    print(f"kimi-k2 int4: {layout.total_bytes / 1e9:.0f} GB of weights, {layout.n_blocks} blocks\n")
    print("| fleet | GPUs | policy | stages | nodes used | planner ms/token | sim ms/token | sim tokens/s per stream "
          "| sim aggregate tokens/s (16 streams, batched) | where a token's time goes (sim) | busiest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for fleet in fleets:
        nodes = fleet.nodes()
        for policy in ("balanced", "min-latency"):
            plan = make_plan(layout, nodes, policy=policy, options=PlanOptions(hop_overhead_ms=hop))
            one = simulate(plan, layout, nodes, SimConfig(streams=1, prompt_tokens=32, decode_tokens=tokens,
                                                          hop_overhead_ms=hop))
            many = simulate(plan, layout, nodes, SimConfig(streams=16, prompt_tokens=1, decode_tokens=tokens // 2,
                                                           hop_overhead_ms=hop))
            parts = ", ".join(f"{k} {v:.0f}" for k, v in one.breakdown_ms.items() if v >= 0.5)
            busiest = many.bottleneck.split("busiest: ")[-1]
            print(f"| {fleet.name} | {len(nodes)} | {policy} | {len(plan.stages)} | {len(plan.peers())} | "
                  f"{plan.predicted.token_latency_ms:.0f} | {one.token_latency_ms:.0f} | {one.stream_tokens_per_s:.1f} | "
                  f"{many.aggregate_tokens_per_s:.0f} | {parts} | {busiest} |")
    print("\nWhat it would take (min-latency plans, one stream; each row adds to the one above):\n")
    print("| fleet | change | stages | sim ms/token | sim tokens/s per stream |")
    print("|---|---|---|---|---|")
    fp8 = layout_from_arch(BUILTIN_ARCHS["kimi-k2"], "int4", activation_bytes_per_value=1)
    for fleet in fleets:
        fast = PlanOptions(hop_overhead_ms=FAST_HOP_MS)
        fast_cfg = SimConfig(hop_overhead_ms=FAST_HOP_MS)
        steps = [
            (f"as planned ({hop:g} ms per message)", fleet, layout, PlanOptions(hop_overhead_ms=hop),
             SimConfig(hop_overhead_ms=hop)),
            (f"transport at {FAST_HOP_MS} ms per message", fleet, layout, fast, fast_cfg),
            ("+ 8-bit activations on the wire", fleet, fp8, fast, fast_cfg),
        ]
        if fleet.uplink_mbit < 1000:
            steps.append(("+ 1 Gbit/s uplinks", replace(fleet, uplink_mbit=1000), fp8, fast, fast_cfg))
        last = steps[-1]
        for label, changes in speculation:
            steps.append((label, last[1], fp8, fast, replace(fast_cfg, **changes)))
        for label, fl, lay, opts, cfg in steps:
            nodes = fl.nodes()
            plan = make_plan(lay, nodes, policy="min-latency", options=opts)
            r = simulate(plan, lay, nodes, replace(cfg, streams=1, prompt_tokens=32, decode_tokens=tokens * 2))
            print(f"| {fleet.name} | {label} | {len(plan.stages)} | {r.token_latency_ms:.1f} | "
                  f"{r.stream_tokens_per_s:.1f} |")
    print(f"\n(made in {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
