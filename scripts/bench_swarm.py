#!/usr/bin/env python3
"""Swarm figures on loopback with real daemons and default (LAN) timings.

  detect      kill -9 of a member -> every survivor marks it dead (target <= 3 s)
  failover    kill -9 of the leader -> all survivors agree on a new leader, then on a new plan
  hang        SIGSTOP of a member (connections stay open) -> every survivor marks it dead; SIGCONT ->
              every survivor counts it alive again
  suspicions  false suspicions while every daemon computes without pause for --load-seconds (target 0)
  all         the four, in that order

Each daemon serves the default model (SmolLM2-135M) and loads the stage the leader gives it. For
`suspicions` every daemon runs its loaded stage (prefill of 32 tokens, then 8 decode steps, again
and again) in a worker thread through `Node.add_extension`, as the pipeline will. Every loop is
bounded; every daemon is started here and stopped by its PID.

  .venv/bin/python scripts/bench_swarm.py all --rounds 5 --load-seconds 60
  (internal) scripts/bench_swarm.py daemon [--burn] <swarmd join options>
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the real-daemon harness the acceptance tests use (tests.swarm.daemons)

from tests.swarm.daemons import Daemon, view, wait_until  # noqa: E402

POLL = 0.05


# --- the daemon with a compute load ---------------------------------------------------------------
async def burn(node, *, task_status=None) -> None:
    """Once `POST /bench/load` arrives, run the node's stage without pause on its compute thread (what
    serving requests does). An extension with its own route and metrics, as the pipeline will add."""
    import trio
    from prometheus_client import Counter
    from starlette.responses import JSONResponse

    passes = Counter("swarmd_bench_forward_passes", "forward passes run by the benchmark load",
                     registry=node.metrics.registry)
    busy = Counter("swarmd_bench_compute_seconds", "seconds spent in forward passes", registry=node.metrics.registry)
    go = trio.Event()

    async def start(request):
        go.set()
        return JSONResponse({"load": "on"})

    node.api.add_route("/bench/load", start, methods=("POST",))
    if task_status is not None:
        task_status.started()
    await go.wait()
    while True:
        stage = node.stage
        if stage is None:
            await trio.sleep(0.2)
            continue
        t0 = time.perf_counter()
        await node.compute.run(forward_once, stage)
        busy.inc(time.perf_counter() - t0)
        passes.inc()


def forward_once(stage) -> None:
    import numpy as np

    from models.stage import StageInput

    rid = "bench-load"
    if not stage.has_request(rid):
        stage.add_request(rid)
    rng = np.random.default_rng(0)

    def rows(n: int):
        if stage.is_first:
            return rng.integers(0, stage.vocab_size, n)
        return rng.standard_normal((n, stage.hidden_size)).astype(np.float32)

    stage.forward([StageInput(rid, 0, rows(32))])
    for pos in range(32, 40):
        stage.forward([StageInput(rid, pos, rows(1))])


def daemon_main(argv: list[str]) -> int:
    import trio

    from swarmd.cli import join

    parser = argparse.ArgumentParser(prog="bench_swarm.py daemon")
    parser.add_argument("--burn", action="store_true")
    sub = parser.add_subparsers(dest="command")
    join.register(sub)
    args = parser.parse_args(["join", *[a for a in argv if a != "--burn"]])
    config = join.build_config(args)
    join.setup_logging(config.log_level)
    return trio.run(join.serve, config, (burn,) if "--burn" in argv else ())


# --- the harness ------------------------------------------------------------------------------------
class BenchDaemon(Daemon):
    burn = False

    def command(self) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "daemon", *(["--burn"] if self.burn else [])]


def start_swarm(root: Path, n: int, bench: Path, burn: bool = False) -> list[BenchDaemon]:
    ds = []
    for i in range(n):
        d = BenchDaemon(root / f"d{i}", model=None, bench_file=bench, swarm="bench")
        d.burn = burn
        ds.append(d)
    try:
        ds[0].start().wait_ready(120)
        for d in ds[1:]:
            d.start(bootstrap=(ds[0].addresses[0],)).wait_ready(120)
        settle(ds)
    except BaseException:
        for d in ds:
            d.stop()
        raise
    return ds


def settle(ds: list[BenchDaemon], timeout: float = 180) -> tuple:
    """Wait until the live daemons agree on leader, plan and members, and every stage is loaded."""
    def check():
        docs = [d.status() for d in ds]
        views = {view(doc) for doc in docs}
        if len(views) != 1:
            return None
        leader, epoch, alive = next(iter(views))
        ready = all(doc["assignment"]["state"] == "ready" for doc in docs)
        return (leader, epoch, alive) if leader and epoch and len(alive) == len(ds) and ready else None

    try:
        return wait_until(check, timeout, "the swarm to settle", interval=0.5)
    except AssertionError:
        for d in ds:
            doc = d.status()
            print(f"{d.peer_id[-6:]}: leader {doc['leader']} epoch {(doc['plan'] or {}).get('epoch')} "
                  f"assignment {doc['assignment']} members "
                  f"{[(m['peer_id'][-6:], m['state']) for m in doc['members']]}", file=sys.stderr)
        raise


def state_of(doc: dict, peer: str) -> str | None:
    return next((m["state"] for m in doc["members"] if m["peer_id"] == peer), None)


def measure_detection(ds: list[BenchDaemon], rounds: int) -> dict:
    out = []
    for r in range(rounds):
        leader = ds[0].status()["leader"]
        victims = [d for d in ds if d.peer_id != leader]
        victim = victims[r % len(victims)]
        survivors = [d for d in ds if d is not victim]
        seen_dead: dict[str, float] = {}
        first_suspect = None
        victim.kill9()
        t0 = time.monotonic()
        while len(seen_dead) < len(survivors) and time.monotonic() - t0 < 30:
            for d in survivors:
                if d.peer_id in seen_dead:
                    continue
                st = state_of(d.status(), victim.peer_id)
                if st in ("suspect", "dead") and first_suspect is None:
                    first_suspect = time.monotonic() - t0
                if st == "dead":
                    seen_dead[d.peer_id] = time.monotonic() - t0
            time.sleep(POLL)
        out.append({"all_dead_s": round(max(seen_dead.values()), 3) if len(seen_dead) == len(survivors) else None,
                    "first_suspect_s": None if first_suspect is None else round(first_suspect, 3)})
        print(f"detect round {r}: {out[-1]}", file=sys.stderr, flush=True)
        victim.addresses, victim.peer_id = [], ""
        victim.start(bootstrap=(survivors[0].addresses[0],)).wait_ready(120)
        settle(ds)
    times = [o["all_dead_s"] for o in out if o["all_dead_s"] is not None]
    return {"rounds": out, "median_all_dead_s": statistics.median(times) if times else None,
            "max_all_dead_s": max(times) if times else None}


def measure_failover(ds: list[BenchDaemon], rounds: int) -> dict:
    out = []
    for r in range(rounds):
        before = ds[0].status()
        leader, epoch, term = before["leader"], before["plan"]["epoch"], before["term"]
        victim = next(d for d in ds if d.peer_id == leader)
        survivors = [d for d in ds if d is not victim]
        victim.kill9()
        t0 = time.monotonic()
        t_leader = t_plan = None
        while time.monotonic() - t0 < 30 and t_plan is None:
            docs = [d.status() for d in survivors]
            leaders = {doc["leader"] for doc in docs}
            if t_leader is None and len(leaders) == 1 and leader not in leaders and None not in leaders \
                    and all(doc["term"] > term for doc in docs):
                t_leader = time.monotonic() - t0
            plans = [doc["plan"] for doc in docs]
            if t_leader is not None and all(p and p["epoch"] > epoch and leader not in
                                            {s["peer_id"] for s in p["stages"]} for p in plans) \
                    and len({p["epoch"] for p in plans}) == 1:
                t_plan = time.monotonic() - t0
            time.sleep(POLL)
        out.append({"new_leader_s": None if t_leader is None else round(t_leader, 3),
                    "new_plan_s": None if t_plan is None else round(t_plan, 3)})
        print(f"failover round {r}: {out[-1]}", file=sys.stderr, flush=True)
        victim.addresses, victim.peer_id = [], ""
        victim.start(bootstrap=(survivors[0].addresses[0],)).wait_ready(120)
        settle(ds)
    lead = [o["new_leader_s"] for o in out if o["new_leader_s"] is not None]
    plan = [o["new_plan_s"] for o in out if o["new_plan_s"] is not None]
    return {"rounds": out, "median_new_leader_s": statistics.median(lead) if lead else None,
            "median_new_plan_s": statistics.median(plan) if plan else None}


def seen_as(observers: list[BenchDaemon], peer: str, state: str, since: float) -> float | None:
    """Seconds since `since` once every observer sees `peer` in `state`, else None."""
    if all(state_of(d.status(), peer) == state for d in observers):
        return time.monotonic() - since
    return None


def measure_hang(ds: list[BenchDaemon], rounds: int) -> dict:
    import signal

    out = []
    for r in range(rounds):
        leader = ds[0].status()["leader"]
        victims = [d for d in ds if d.peer_id != leader]
        victim = victims[r % len(victims)]
        survivors = [d for d in ds if d is not victim]
        victim.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            dead_at = wait_until(lambda: seen_as(survivors, victim.peer_id, "dead", t0), 30,  # noqa: B023
                                 "the hung member to be marked dead", interval=POLL)
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        t1 = time.monotonic()
        back_at = wait_until(lambda: seen_as(survivors, victim.peer_id, "alive", t1), 30,  # noqa: B023
                             "the resumed member to be alive", interval=POLL)
        out.append({"all_dead_s": round(dead_at, 3), "alive_again_s": round(back_at, 3)})
        print(f"hang round {r}: {out[-1]}", file=sys.stderr, flush=True)
        settle(ds)
    dead = [o["all_dead_s"] for o in out]
    back = [o["alive_again_s"] for o in out]
    return {"rounds": out, "median_all_dead_s": statistics.median(dead), "median_alive_again_s": statistics.median(back)}


COUNTERS = ("swarmd_transitions_to_suspect_total", "swarmd_transitions_to_dead_total", "swarmd_probes_failed_total",
            "swarmd_bench_forward_passes_total", "swarmd_bench_compute_seconds_total", "swarmd_heartbeats_sent_total")


def counters(d: BenchDaemon) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{d.api}/metrics", timeout=5).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^(\w+) ([0-9.e+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] = float(m.group(2))
    return out


def measure_suspicions(root: Path, n: int, bench: Path, seconds: float) -> dict:
    import httpx

    ds = start_swarm(root, n, bench, burn=True)
    try:
        for d in ds:
            httpx.post(f"{d.api}/bench/load", timeout=5)
        wait_until(lambda: all(counters(d)["swarmd_bench_forward_passes_total"] > 0 for d in ds), 120,
                   "the compute load to start", interval=1.0)
        before = [counters(d) for d in ds]
        load0 = os.getloadavg()[0]
        time.sleep(seconds)
        after = [counters(d) for d in ds]
        delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in COUNTERS}
        return {
            "seconds": seconds,
            "daemons": n,
            "false_suspicions": int(delta["swarmd_transitions_to_suspect_total"]),
            "false_deaths": int(delta["swarmd_transitions_to_dead_total"]),
            "failed_probes": int(delta["swarmd_probes_failed_total"]),
            "forward_passes": int(delta["swarmd_bench_forward_passes_total"]),
            "compute_busy_fraction_per_daemon": round(delta["swarmd_bench_compute_seconds_total"] / (n * seconds), 3),
            "heartbeats_sent": int(delta["swarmd_heartbeats_sent_total"]),
            "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
        }
    finally:
        for d in ds:
            d.stop()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "daemon":
        return daemon_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["detect", "failover", "hang", "suspicions", "all"])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--load-seconds", type=float, default=60.0)
    ap.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = ap.parse_args()

    from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

    results: dict = {"nodes": args.nodes, "timings": "lan (defaults)", "python": sys.version.split()[0],
                     "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-") as tmp:
        root = Path(tmp)
        device = resolve_device("auto")
        load_or_measure(root, device, device_name(device))
        bench = root / BENCH_FILE
        if args.what in ("detect", "failover", "hang", "all"):
            ds = start_swarm(root / "swarm", args.nodes, bench)
            try:
                if args.what in ("detect", "all"):
                    results["detect"] = measure_detection(ds, args.rounds)
                if args.what in ("failover", "all"):
                    results["failover"] = measure_failover(ds, args.rounds)
                if args.what in ("hang", "all"):
                    results["hang"] = measure_hang(ds, args.rounds)
            finally:
                for d in ds:
                    d.stop()
        if args.what in ("suspicions", "all"):
            results["suspicions"] = measure_suspicions(root / "loaded", args.nodes, bench, args.load_seconds)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
