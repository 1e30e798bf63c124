#!/usr/bin/env python3
"""The membership gossip a daemon handles as the swarm grows: whole `SwarmService`s on the in-memory network, in
virtual time (no model, no libp2p: every heartbeat reaches every member once).

For each swarm size, starts that many members, lets them settle, then counts over `--seconds` of virtual time, per
member: the gossip messages it received and the heartbeats it published (per second, medians over the members),
the members it came to suspect, and this process's CPU per virtual second for the whole swarm (the membership's
own Python: decoding, checking and ingesting each message). py-libp2p's cost per message comes on top on real
daemons (docs/BENCHMARKS.md).

    .venv/bin/python scripts/bench_gossip.py --members 4,8,16,32,52
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import trio
import trio.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarmd.testing.memory_network import MemoryHub  # noqa: E402
from tests.swarm.memory_swarm import Swarm  # noqa: E402


def measure(members: int, settle: float, seconds: float) -> dict[str, float]:
    result: dict[str, float] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            hub = await nursery.start(MemoryHub().run)
            swarm = Swarm(nursery, hub)
            founder = await swarm.start(1)
            for n in range(2, members + 1):
                await swarm.start(n, bootstrap=founder.peer_id)
            services = list(swarm.services.values())
            await trio.sleep(settle)
            keys = ("messages_received", "heartbeats_sent", "transitions_to_suspect")
            before = [{k: s.stats[k] for k in keys} for s in services]
            cpu = time.process_time()
            await trio.sleep(seconds)
            cpu = time.process_time() - cpu
            deltas = [{k: s.stats[k] - b[k] for k in keys} for s, b in zip(services, before, strict=True)]
            result.update(
                received=statistics.median(d["messages_received"] for d in deltas) / seconds,
                sent=statistics.median(d["heartbeats_sent"] for d in deltas) / seconds,
                suspected=sum(d["transitions_to_suspect"] for d in deltas),
                live=statistics.median(len(s.membership.live()) for s in services),
                cpu_ms=1000 * cpu / seconds)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", default="4,8,16,32,52", help="swarm sizes, comma-separated")
    ap.add_argument("--settle", type=float, default=60.0, help="virtual seconds before counting")
    ap.add_argument("--seconds", type=float, default=60.0, help="virtual seconds counted")
    args = ap.parse_args()
    print(f"LAN timings, {args.seconds:.0f} virtual s after {args.settle:.0f} s to settle; per member, medians")
    print("| members | gossip messages received / s | heartbeats published / s | suspicions (all members) "
          "| members seen live | CPU ms per virtual s, whole swarm |")
    print("|---|---|---|---|---|---|")
    for n in (int(v) for v in args.members.split(",")):
        r = measure(n, args.settle, args.seconds)
        print(f"| {n} | {r['received']:.2f} | {r['sent']:.2f} | {r['suspected']:.0f} | {r['live']:.0f} "
              f"| {r['cpu_ms']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
