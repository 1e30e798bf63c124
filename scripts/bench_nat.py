#!/usr/bin/env python3
"""Decode speed of a 3-stage SmolLM2 pipeline across NATs, and how long a daemon behind NAT takes to be ready.

Three swarms of three real `swarmd join` processes run at once, each in network namespaces of its own
(tests/netns/topology.py; needs root, `ip`, `nft`):

    loopback   the three daemons in one namespace on 127.0.0.1 (the baseline)
    direct     a public founder and two homes behind NATs that drop unsolicited connections: the two homes
               end up hole-punched, every link direct
    relayed    the same behind NATs that answer with RST: hole punching fails, the homes' link goes through
               the founder's relay

Each round sends the same prompt to each swarm in turn (the order rotates), through `swarmd submit-prompt
--json` in a home's namespace (the founder's for loopback), after one warm-up request per swarm; the figure is
the median of the rounds' decode tokens/s as the head measured it. Join-to-ready: from starting `swarmd join`
behind NAT to the founder seeing every stage of the plan loaded, and to the home's link to the other home being
hole-punched (direct) or known relayed.

    .venv/bin/python scripts/bench_nat.py --rounds 5 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "The history of the printing press begins in"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    args = ap.parse_args()

    from tests.netns.nat_swarm import NatSwarm
    from tests.netns.topology import missing_tools
    from tests.swarm.daemons import wait_until

    why = missing_tools()
    if why:
        sys.exit(f"bench_nat: {why}")
    base = Path(tempfile.mkdtemp(prefix="bench-nat-"))
    swarms: dict[str, NatSwarm] = {}
    result: dict = {"python": platform.python_version(), "cpus": os.cpu_count(), "command": " ".join(sys.argv),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "tokens": args.tokens}
    try:
        ready = {}
        for name, nat in (("loopback", "loopback"), ("direct", "drop"), ("relayed", "rst")):
            started = time.monotonic()
            s = swarms[name] = NatSwarm(base / name, None, nat).start()
            print(f"{name}: ready in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
            if nat == "loopback":
                continue
            want = ("direct", "data-plane") if nat == "drop" else ("relayed",)
            wait_until(lambda s=s, want=want, nat=nat: s.link(1, 2)["path"] in want and
                       (nat == "drop" or "failed" in s.link(1, 2)["reason"]), 300, f"{name} link")
            home = s.daemons[1]
            ready[name] = {"join_to_chain_ready_s": s.joined_s,
                           "join_to_link_settled_s": round(time.monotonic() - home.started_at, 1),
                           "link": s.link(1, 2), "hole_punching": home.status()["connectivity"]["hole_punching"]}
        result["join_behind_nat"] = ready
        via = {"loopback": 0, "direct": 1, "relayed": 1}
        for name, s in swarms.items():  # warm-up: kernels compile on each stage's first request
            code, _, err = s.submit(via[name], PROMPT, args.tokens)
            if code != 0:
                sys.exit(f"{name}: warm-up failed: {err}")
        rates: dict[str, list[float]] = {name: [] for name in swarms}
        texts: dict[str, set[str]] = {name: set() for name in swarms}
        names = list(swarms)
        for rnd in range(args.rounds):
            for name in names[rnd % 3:] + names[: rnd % 3]:
                code, res, err = swarms[name].submit(via[name], PROMPT, args.tokens)
                if code != 0:
                    sys.exit(f"{name}: round {rnd + 1} failed: {err}")
                rates[name].append(res["timings"]["decode_tokens_per_s"])
                texts[name].add(res["text"])
            print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(f"{n} {rates[n][-1]:.2f}" for n in names),
                  file=sys.stderr, flush=True)
        base_rate = statistics.median(rates["loopback"])
        result["decode_tokens_per_s"] = {
            name: {"median": round(statistics.median(r), 2), "rounds": r,
                   "x_loopback": round(statistics.median(r) / base_rate, 2)} for name, r in rates.items()}
        result["same_text_everywhere"] = len(set().union(*texts.values())) == 1
    finally:
        for s in swarms.values():
            s.stop()
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
