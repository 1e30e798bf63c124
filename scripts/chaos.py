#!/usr/bin/env python3
"""Chaos: random fault schedules over a swarm of real daemons on loopback, each request judged and counted.

    .venv/bin/python scripts/chaos.py --daemons 5 --schedules 20 --seed 1
    .venv/bin/python scripts/chaos.py --daemons 4 --schedules 3 --max-tokens 12      # the CI subset's size
    .venv/bin/python scripts/chaos.py --moe --daemons 5 --schedules 20 --seed 1       # a MoE swarm, expert kills

Each daemon is reached through its own emulated link (`scripts/link_emulator.py`). A schedule sends one
request (greedy, so its tokens are known from an undisturbed run) and, at random tokens of it, injects faults:
resets of random links, a delay spike on a link, `kill -9` of a stage or of the leader, SIGTERM of a stage.
With `--moe` the swarm serves a tiny synthetic MoE (4 blocks, 8 experts, top-2): the last daemon holds only
routed experts (half of each MoE block's, no replicas) and faults also include `kill -9` of that expert node.
The request ends `correct` (the undisturbed tokens, each step once), with a `clear error` (an error event
with a code and a message), `hung` (no end within the deadline) or `cut` (the stream broke: its head was
killed). A daemon that exits without being told to is `crashed`. Killed daemons are started again (same
identity) between schedules, so the swarm stays at its size. Bounded: at most `--schedules` schedules, each
within `--deadline` seconds, the whole run within `--budget` seconds. Prints the counts as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults.fault_swarm import FaultSwarm  # noqa: E402
from tests.moe.moe_swarm import ExpertNodeSwarm, write_tiny_moe  # noqa: E402
from tests.swarm.daemons import wait_until  # noqa: E402

PROMPT = "The history of the printing press begins in"
FAULTS = ("reset", "reset", "delay", "kill_stage", "kill_leader", "leave")
MOE_FAULTS = (*FAULTS, "kill_experts", "kill_experts")  # over a MoE swarm with an expert-only node
REMOVALS = ("kill_stage", "kill_leader", "leave", "kill_experts")


def say(line: str) -> None:
    print(f"[chaos] {line}", file=sys.stderr, flush=True)


@dataclass
class Schedule:
    """Faults to inject after the given token counts: [(after_tokens, fault)]."""

    faults: list[tuple[int, str]]
    via: int  # the daemon (index) the request goes to

    @staticmethod
    def draw(rng: random.Random, n_tokens: int, alive: list[int], max_faults: int,
             kinds: tuple[str, ...] = FAULTS) -> Schedule:
        k = rng.randint(1, max_faults)
        faults = sorted((rng.randint(1, max(1, n_tokens - 2)), rng.choice(kinds)) for _ in range(k))
        removals = [f for f in faults if f[1] in REMOVALS]
        for extra in removals[max(0, len(alive) - 2):]:  # keep at least two daemons
            faults.remove(extra)
        return Schedule(faults, rng.choice(alive))


@dataclass
class Chaos:
    swarm: FaultSwarm
    rng: random.Random
    n_tokens: int
    deadline: float
    stopped: set[int] = field(default_factory=set)  # daemons we killed or told to leave
    counts: Counter = field(default_factory=Counter)

    def alive(self) -> list[int]:
        return [i for i, d in enumerate(self.swarm.daemons) if d.proc is not None and d.proc.poll() is None]

    def inject(self, fault: str, via: int) -> str:
        alive = [i for i in self.alive() if i != via]
        status = self.swarm.daemons[via].status()
        leader = status["leader"]
        stages = [s["peer_id"] for s in (status["plan"] or {"stages": []})["stages"]]
        if fault == "reset":
            names = self.rng.sample(sorted(self.swarm.links.ports), self.rng.randint(1, len(self.swarm.links.ports)))
            for name in names:
                self.swarm.links.reset(name)
            return f"reset {','.join(names)}"
        if fault == "delay":
            name = self.rng.choice(sorted(self.swarm.links.ports))
            self.swarm.links.set(name, delay_ms=200)
            threading.Timer(2.0, lambda: self.swarm.links.set(name, delay_ms=0)).start()
            return f"delay spike on {name}"
        if len(self.alive()) <= 2:
            return "none (two daemons left)"
        if fault == "kill_leader":
            targets = [i for i in alive if self.swarm.peers[i] == leader]
        elif fault == "kill_experts":  # a node holding experts and no stage
            plan = status["plan"] or {}
            holders = {p for by in (plan.get("experts") or {}).values() for ps in by.values() for p in ps}
            targets = [i for i in alive if self.swarm.peers[i] in holders - set(stages)]
        else:
            targets = [i for i in alive if self.swarm.peers[i] in stages and self.swarm.peers[i] != leader]
        if not targets:
            return f"none ({fault}: no such daemon besides the head)"
        victim = self.rng.choice(targets)
        self.stopped.add(victim)
        proc = self.swarm.daemons[victim].proc
        assert proc is not None
        proc.send_signal(signal.SIGTERM if fault == "leave" else signal.SIGKILL)
        return f"{fault} d{victim}"

    def run_one(self, schedule: Schedule, expected: list[tuple[int, int]]) -> str:
        pending = list(schedule.faults)
        done: list[str] = []

        def on_token(n: int) -> None:
            while pending and pending[0][0] <= n:
                done.append(self.inject(pending.pop(0)[1], schedule.via))

        result: dict[str, Any] = {}

        def request() -> None:
            try:
                result["pairs"], result["end"] = self.swarm.stream(schedule.via, prompt=PROMPT,
                                                                   max_tokens=self.n_tokens, on_token=on_token,
                                                                   read_timeout=self.deadline)
            except Exception as e:  # the head was killed or the stream broke
                result["end"] = {"event": "cut", "error": f"{type(e).__name__}: {e}"}

        t = threading.Thread(target=request, daemon=True)
        t.start()
        t.join(self.deadline)
        if t.is_alive():
            outcome = "hung"
        elif result["end"]["event"] == "done" and result["pairs"] == expected:
            outcome = "correct"
        elif result["end"]["event"] in ("error", "http_error") and result["end"].get("code"):
            outcome = "clear error"
        elif result["end"]["event"] == "cut" and schedule.via in self.stopped:
            outcome = "cut (head killed)"
        else:
            outcome = "wrong"
        say(f"via d{schedule.via}, faults {done or 'none'}: {outcome} {'' if outcome == 'correct' else result.get('end')}")
        return outcome

    def crashed(self) -> list[int]:
        return [i for i, d in enumerate(self.swarm.daemons)
                if i not in self.stopped and d.proc is not None and d.proc.poll() is not None]

    def heal(self, timeout: float) -> None:
        """Start the daemons we stopped again and wait for a ready chain over all of them."""
        alive = self.alive()
        boot = tuple(f"{self.swarm.announced(i)}/p2p/{self.swarm.peers[i]}" for i in alive[:1])
        for i in sorted(self.stopped):
            self.swarm.start_daemon(i, boot)
        for i in sorted(self.stopped):
            self.swarm.daemons[i].wait_ready(60)
        self.stopped.clear()
        n = len(self.swarm.daemons)
        wait_until(lambda: self.swarm.pipeline()["chain"]["ready"] and
                   len(self.swarm.running[0].status()["plan"]["stages"]) >= min(n, 2), timeout, "a ready chain")
        if isinstance(self.swarm, ExpertNodeSwarm):  # and every expert of the plan loaded by a holder
            self.swarm.wait_chain(timeout=timeout, everyone=False)


def run_chaos(swarm: FaultSwarm, *, schedules: int, seed: int, n_tokens: int, deadline: float, budget: float,
              max_faults: int = 3, kinds: tuple[str, ...] = FAULTS) -> Counter:
    """Run up to `schedules` schedules (within `budget` s); the counts of outcomes and crashed daemons."""
    rng = random.Random(seed)
    expected, end = swarm.stream(0, prompt=PROMPT, max_tokens=n_tokens)
    if end["event"] != "done":
        raise RuntimeError(f"the undisturbed run failed: {end}")
    chaos = Chaos(swarm, rng, n_tokens, deadline)
    started = time.monotonic()
    for k in range(schedules):
        if time.monotonic() - started > budget:
            say(f"budget of {budget:.0f} s spent after {k} schedules")
            break
        chaos.counts[chaos.run_one(Schedule.draw(rng, n_tokens, chaos.alive(), max_faults, kinds), expected)] += 1
        crashed = chaos.crashed()
        chaos.counts["crashed daemons"] += len(crashed)
        chaos.stopped.update(crashed)
        if chaos.stopped and k + 1 < schedules:  # the next schedule starts from the whole swarm
            chaos.heal(deadline)
    chaos.counts["schedules"] = sum(chaos.counts[o] for o in ("correct", "clear error", "hung", "wrong",
                                                             "cut (head killed)"))
    return chaos.counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--daemons", type=int, default=5)
    p.add_argument("--schedules", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-faults", type=int, default=3, help="faults per schedule, at most")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds a request may take, faults included")
    p.add_argument("--budget", type=float, default=1800.0, help="seconds for the whole run")
    p.add_argument("--moe", action="store_true", help="a MoE swarm whose last daemon holds only experts")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarmd-chaos-") as tmp:
        base = Path(tmp)
        from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

        device = resolve_device("auto")
        load_or_measure(base, device, device_name(device))
        if args.moe:
            model = write_tiny_moe(base / "tiny-moe.gguf")
            swarm: FaultSwarm = ExpertNodeSwarm(base / "swarm", base / BENCH_FILE, args.daemons, str(model))
        else:
            swarm = FaultSwarm(base / "swarm", base / BENCH_FILE, args.daemons, extra=("--max-context", "256"))
        try:
            say(f"starting {args.daemons} daemons")
            swarm.start()
            counts = run_chaos(swarm, schedules=args.schedules, seed=args.seed, n_tokens=args.max_tokens,
                               deadline=args.deadline, budget=args.budget, max_faults=args.max_faults,
                               kinds=MOE_FAULTS if args.moe else FAULTS)
        finally:
            swarm.stop()
    print(json.dumps(dict(counts)))
    return 0 if counts["hung"] == counts["wrong"] == counts["crashed daemons"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
