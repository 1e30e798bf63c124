#!/usr/bin/env python3
"""How long make_plan takes for Kimi-K2 (int4) over 1,000 simulated consumer GPUs.

The target is under 2 s on the project's 2-core machine. Each fleet carries a full RTT matrix
(999 entries per descriptor), as gossiped descriptors would. Policies are timed in turns, round
after round, so that machine noise hits them alike; the medians are what to quote.

    .venv/bin/python scripts/bench_planner.py --rounds 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from planner import BUILTIN_ARCHS, layout_from_arch, make_plan
from planner.fleet import make_fleet

FLEET = "400x4090,300x3090,200x3060,100x4060ti"
SHAPES = {
    "1 region, RTT 1 ms, 1 Gbit/s": dict(regions=1, rtt_ms=(1.0, 1.0), uplink_mbit=1000),
    "8 regions, RTT 10/120 ms, 100 Mbit/s": dict(regions=8, rtt_ms=(10.0, 120.0), uplink_mbit=100),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    layout = layout_from_arch(BUILTIN_ARCHS["kimi-k2"], "int4")
    print(f"# {platform.python_implementation()} {platform.python_version()}, {platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}; fleet {FLEET} (1000 nodes), kimi-k2 int4, {args.rounds} rounds")
    print("| fleet shape | policy | median s | min s | max s | stages | nodes used |")
    print("|---|---|---|---|---|---|---|")
    for shape, kw in SHAPES.items():
        nodes = make_fleet(FLEET, **kw)
        times: dict[str, list[float]] = {"balanced": [], "min-latency": []}
        plans = {}
        for _ in range(args.rounds):
            for policy in times:
                t0 = time.perf_counter()
                plans[policy] = make_plan(layout, nodes, policy=policy)
                times[policy].append(time.perf_counter() - t0)
        for policy, ts in times.items():
            plan = plans[policy]
            print(f"| {shape} | {policy} | {statistics.median(ts):.2f} | {min(ts):.2f} | {max(ts):.2f} | "
                  f"{len(plan.stages)} | {len(plan.peers())} |")


if __name__ == "__main__":
    main()
