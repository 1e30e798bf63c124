#!/usr/bin/env python3
"""Fault-tolerance figures: recovery from `kill -9` of a stage, split into its parts, and the cost of resets.

    .venv/bin/python scripts/bench_faults.py --daemons 3 --tokens 32 --kills 2
    .venv/bin/python scripts/bench_faults.py --daemons 3 --standby 1 --tokens 32 --kills 2 --skip-resets
    .venv/bin/python scripts/bench_faults.py --daemons 3 --standby 1 --compare-rebuild --long-prompt \
        --tokens 40 --kill-after 24 --kills 6 --skip-resets
    .venv/bin/python scripts/bench_faults.py --daemons 3 --compare-reload --tokens 32 --kills 6
    .venv/bin/python scripts/bench_faults.py --daemons 3 --compare-code REV --tokens 32 --kills 8
    .venv/bin/python scripts/bench_faults.py --skip-kill --reset-rates 0,0.01,0.05
    .venv/bin/python scripts/bench_faults.py --expert-node --tokens 32 --kills 3

Starts a swarm of real daemons on loopback, each behind an emulated link (`scripts/link_emulator.py`), serving
SmolLM2 (the kernel cache is warm after the first request). Then:

* recovery: a greedy request through the leader; after `--kill-after` tokens a stage that is neither the head
  nor the leader gets `kill -9` (with `--standby`, the stage a spare holds a warm copy of). With `--kills K`
  the killed daemon is started again (as the new spare, with `--standby`) and the swarm re-formed before
  the next kill; the parts are given per run and as medians. From the daemons' logs and the head's own record of the move:
  detection (kill -> the leader marks the member dead), re-plan (-> the head has the new plan), weight loading
  (the slowest stage that loaded blocks for that plan), replay (the head sends the token history to the new
  chain -> the next token: kernel compilation, with a warm cache only lookups, and the KV rebuild), the total
  (kill -> the next token), and tokens lost (streamed tokens that differ from the undisturbed run's, or repeat).
* rebuild paths (`--compare-rebuild`, with `--standby`): the same kills, alternately under a request headed by
  the leader (the hop-local rebuild: the stages that stay keep the request's KV cache, only the spare rebuilds
  its own) and by the other surviving stage's daemon, started with `swarmd join --full-replay` (every stage
  prefills the whole history again); the parts per path, as medians side by side. `--long-prompt` gives a
  history long enough for the difference to show.
* block reuse (`--compare-reload`, no standby): two swarms side by side, one of daemons started with
  `swarmd join --full-reload` (a survivor whose block range grows reads the whole new range, as before) and
  one without (it keeps the blocks it holds and reads only the others); the `--kills` kills alternate between
  them, each swarm's victim started again before its next kill; the parts per swarm, as medians side by side.
* graph cache (`--compare-code REV`, no standby): as `--compare-reload`, two swarms side by side, one running
  this code with a graph cache of the run's own (empty at the start: the first kill grows the survivors'
  ranges with their graphs captured, the later kills find them cached) and one running the code of revision REV
  (a copy outside the repository, or the directory REV names); this code's first kill is reported apart.
* resets (on the daemons left after the kill): the same request with each link resetting every forwarded chunk
  with probability p; decode tokens/s side by side with p = 0 (medians of `--repeats` runs), frames the
  transports resent, and runs whose tokens differed or that failed.

* expert node (`--expert-node`, instead of the above): a tiny synthetic MoE (4 blocks, 8 experts, top-2) on
  three stage daemons and one daemon holding only experts (half of each MoE block's), twice side by side:
  with a replica of each of its experts on a stage node, and without. After `--kill-after` tokens the expert
  node gets `kill -9`; per run: kill -> the next token, detection (kill -> the head marks it dead),
  re-plan (-> the head has the plan without it), kill -> the last survivor holding its re-placed experts,
  whether a step waited for that plan, and tokens lost.
  The expert node is started again between runs (the founder adopts its plan file again).

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
LONG_PROMPT = (
    "The printing press changed how knowledge moved through Europe. Before it, books were copied by hand in "
    "monasteries and workshops, a slow and costly labour that kept them rare. Around 1440 a goldsmith in Mainz "
    "combined movable metal type, an oil-based ink and a screw press adapted from those used for wine and "
    "paper. Within fifty years presses were running in more than two hundred cities, and millions of volumes "
    "had been printed: bibles, grammars, almanacs, pamphlets and broadsheets. Scholars could compare identical "
    "copies, merchants could print price lists, and reformers could spread their arguments faster than "
    "authorities could answer them. The history of the printing press begins in")
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


def victim_and_head(swarm: FaultSwarm) -> tuple[int, int]:
    """The stage to kill and the daemon that heads the request: with a standby, the stage it holds a copy of
    (else a stage that is not the leader); the head is the leader unless that is the victim."""
    status = swarm.running[0].status()
    plan, leader = status["plan"], status["leader"]
    copies = set(swarm.standby_of(plan).values())
    stages = [s["peer_id"] for s in plan["stages"]]
    if copies:
        victim = next(swarm.index_of(s["peer_id"]) for s in plan["stages"] if tuple(s["layers"]) in copies)
    else:
        victim = next(swarm.index_of(p) for p in stages if p != leader)
    head = swarm.index_of(leader)
    if head == victim:
        head = next(swarm.index_of(p) for p in stages if swarm.index_of(p) != victim)
    return victim, head


def log_lines(path: Path, after: float, before: float) -> list[tuple[float, str]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        t = log_time(line)
        if t is not None and after - 0.002 <= t <= before:
            out.append((t, line))
    return out


def stream_killing(swarm: Any, head: int, tokens: int, kill_after: int, victim: int, prompt: str = PROMPT
                   ) -> tuple[list[tuple[int, int]], dict[str, Any], dict[str, float], list[tuple[float, float]]]:
    """A request through `head` whose token `kill_after` kill -9s `victim`: its tokens and end, when the kill
    happened ("wall", "perf") and (perf_counter, wall clock) of each token. RuntimeError if it failed."""
    killed: dict[str, float] = {}
    arrivals: list[tuple[float, float]] = []

    def on_token(n: int) -> None:
        arrivals.append((time.perf_counter(), time.time()))
        if n == kill_after:
            killed["wall"], killed["perf"] = time.time(), time.perf_counter()
            swarm.daemons[victim].kill9()

    pairs, end = swarm.stream(head, prompt=prompt, max_tokens=tokens, on_token=on_token)
    if end["event"] != "done":
        raise RuntimeError(f"the request failed: {end}")
    return pairs, end, killed, arrivals


def recovery(swarm: FaultSwarm, tokens: int, kill_after: int, *, prompt: str = PROMPT,
             head: int | None = None) -> dict[str, Any]:
    """One kill -9 under a request (headed by `head`, by default the leader) and its parts."""
    victim, leader_head = victim_and_head(swarm)
    head = leader_head if head is None else head
    if head == victim:
        raise RuntimeError(f"daemon {head} cannot head the request: it is the stage to kill")
    leader = swarm.index_of(swarm.running[0].status()["leader"])
    expected, _ = swarm.stream(head, prompt=prompt, max_tokens=tokens)
    pairs, end, killed, arrivals = stream_killing(swarm, head, tokens, kill_after, victim, prompt)
    after_kill = [(p, w) for p, w in arrivals if p > killed["perf"]]
    until = after_kill[0][1] if after_kill else time.time()
    short = swarm.peers[victim][-6:]
    dead = next(((t, ln) for t, ln in log_lines(swarm.daemons[leader].log_path, killed["wall"], until)
                 if re.search(rf"member {short}: .*-> dead", ln)), None)
    planned = next(((t, ln) for t, ln in log_lines(swarm.daemons[head].log_path, killed["wall"], until)
                    if re.search(r"plan epoch \d+ from", ln)), None)
    loads, warm = [], 0
    for i, d in enumerate(swarm.daemons):
        if i == victim:
            continue
        for _, line in log_lines(d.log_path, killed["wall"], until):
            m = re.search(r"ready: blocks \d+-\d+ loaded in ([\d.]+) s", line)
            if m:
                loads.append(float(m.group(1)))
                warm += "graphs from the graph cache" in line
    rec = end.get("recoveries", [{}])[0]
    return {
        "daemons": len(swarm.running) + 1, "tokens": tokens, "killed_after_token": kill_after,
        "detection_s": round(dead[0] - killed["wall"], 3) if dead else None,
        "detected_by": dead[1].split("(", 1)[-1].rstrip(")") if dead else None,
        "replan_s": round(planned[0] - dead[0], 3) if dead and planned else None,
        "weight_loading_s": max(loads) if loads else 0.0,
        "stages_warm_from_graph_cache": warm,
        "wait_for_chain_s": rec.get("wait_for_chain_s"),
        "replay_compile_and_kv_rebuild_s": rec.get("replay_s"),
        "replayed_tokens": rec.get("replayed_tokens"),
        "rebuild": rec.get("rebuild"), "kept_hops": rec.get("kept_hops"), "head": head,
        "kill_to_next_token_s": round(after_kill[0][0] - killed["perf"], 3) if after_kill else None,
        "tokens_lost": sum(1 for a, b in zip(pairs, expected, strict=False) if a != b) + abs(len(pairs) - len(expected)),
        "same_tokens": pairs == expected,
        "victim": victim,
    }


def restore(swarm: FaultSwarm, victim: int, n_stages: int) -> None:
    """Start the killed daemon again (a spare again when the run has standbys) and wait for the full swarm."""
    if swarm.spares:
        swarm.spares.add(victim)  # the spare that took its stage over serves it now; the restarted one stands by
    via = next(i for i, d in enumerate(swarm.daemons) if d in swarm.running)
    swarm.start_daemon(victim, (f"{swarm.announced(via)}/p2p/{swarm.peers[via]}",))
    swarm.daemons[victim].wait_ready(60)
    swarm.wait_chain(n_stages, 600)


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("detection_s", "replan_s", "weight_loading_s", "wait_for_chain_s", "replay_compile_and_kv_rebuild_s",
            "replayed_tokens",
            "kill_to_next_token_s", "tokens_lost")
    out: dict[str, Any] = {}
    for k in keys:
        values = [r[k] for r in runs if r.get(k) is not None]
        out[k] = round(statistics.median(values), 3) if values else None
    out["runs"] = len(runs)
    out["all_same_tokens"] = all(r["same_tokens"] for r in runs)
    return out


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


def expert_recovery(swarm: Any, tokens: int, kill_after: int) -> dict[str, Any]:
    """Kill the expert node of an `ExpertNodeSwarm` under a request headed by daemon 0: the figures."""
    victim, head = swarm.expert_node, 0
    served_before = swarm.pipeline(victim)["moe"]["expert"]["batches"]
    expected, _ = swarm.stream(head, prompt=PROMPT, max_tokens=tokens)
    served = swarm.pipeline(victim)["moe"]["expert"]["batches"] - served_before  # by the expert node, undisturbed
    waited_before = sum(swarm.pipeline(i)["moe"]["router"]["waited_for_plan"] for i in range(len(swarm.running)))
    pairs, end, killed, arrivals = stream_killing(swarm, head, tokens, kill_after, victim)
    after_kill = [p for p, _ in arrivals if p > killed["perf"]]
    short = swarm.peers[victim][-6:]
    lines = log_lines(swarm.daemons[head].log_path, killed["wall"], time.time())
    dead = next((t for t, ln in lines if re.search(rf"member {short}: .*-> dead", ln)), None)
    planned = next((t for t, ln in lines if re.search(r"plan epoch \d+ from", ln)), None)
    waited = sum(swarm.pipeline(i)["moe"]["router"]["waited_for_plan"] for i in range(len(swarm.running)))
    next_token = killed["wall"] + (after_kill[0] - killed["perf"]) if after_kill else time.time()
    loaded = [t for i, d in enumerate(swarm.daemons) if i != victim
              for t, ln in log_lines(d.log_path, killed["wall"], next_token) if re.search(r"loaded \d+ experts", ln)]
    return {
        "tokens": tokens, "killed_after_token": kill_after, "expert_node_batches_undisturbed": served,
        "kill_to_next_token_s": round(after_kill[0] - killed["perf"], 3) if after_kill else None,
        "detection_s": round(dead - killed["wall"], 3) if dead else None,
        "replan_s": round(planned - dead, 3) if dead and planned else None,
        "experts_reloaded_s": round(max(loaded) - killed["wall"], 3) if loaded else None,  # kill -> last survivor ready
        "steps_that_waited_for_the_plan": waited - waited_before,
        "tokens_lost": sum(1 for a, b in zip(pairs, expected, strict=False) if a != b) + abs(len(pairs) - len(expected)),
        "same_tokens": pairs == expected,
        "moved": bool(end.get("recoveries")),
    }


def expert_node_runs(base: Path, bench_file: Path, model: Path, replicas: bool, args: argparse.Namespace) -> dict[str, Any]:
    """`--kills` expert node kills over one swarm (with or without replicas of its experts), and medians."""
    from swarmd.inference.moe.dispatch import ReplicaChooser
    from tests.moe.moe_swarm import ExpertNodeSwarm

    swarm = ExpertNodeSwarm(base, bench_file, 4, str(model), replicated=None if replicas else frozenset())
    runs = []
    try:
        say(f"starting 3 stage daemons and an expert node ({'with' if replicas else 'no'} replicas)")
        swarm.start()
        swarm.stream(0, prompt=PROMPT, max_tokens=4)  # warm every stage's kernels
        for k in range(args.kills):
            if k:
                swarm.start_daemon(swarm.expert_node, (f"{swarm.announced(0)}/p2p/{swarm.peers[0]}",))
                swarm.daemons[swarm.expert_node].wait_ready(60)
                swarm.wait_chain(timeout=300)
                swarm.stream(0, prompt=PROMPT, max_tokens=4)
            # the routers shun a holder whose last call was slow (its first batch compiles) or failed, until
            # their estimate of it relaxes (ReplicaChooser.half_life_s): let it, so that the expert node is used
            time.sleep(4 * ReplicaChooser.half_life_s)
            say(f"kill -9 of the expert node ({k + 1} of {args.kills})")
            runs.append(expert_recovery(swarm, args.tokens, args.kill_after))
            say(json.dumps(runs[-1]))
    finally:
        swarm.stop()
    out: dict[str, Any] = {}
    for key in ("kill_to_next_token_s", "detection_s", "replan_s", "experts_reloaded_s", "tokens_lost"):
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    out["all_same_tokens"] = all(r["same_tokens"] for r in runs)
    return {"runs": runs, "median": out}


def reload_runs(base: Path, bench_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`--kills` kills alternating between a swarm whose survivors keep their blocks and one started with
    --full-reload; both swarms run all along, so that the two see the same load."""
    swarms = {"kept_blocks": FaultSwarm(base / "kept", bench_file, args.daemons, extra=("--max-context", "256")),
              "full_reload": FaultSwarm(base / "full", bench_file, args.daemons,
                                        extra=("--max-context", "256", "--full-reload"))}
    runs: list[dict[str, Any]] = []
    try:
        for name, swarm in swarms.items():
            say(f"starting {args.daemons} daemons ({name})")
            swarm.start()
            swarm.stream(0, prompt=PROMPT, max_tokens=4)  # warm every stage's kernels
        for k in range(args.kills):
            name = list(swarms)[k % 2]
            swarm = swarms[name]
            if k >= 2:
                restore(swarm, runs[k - 2]["victim"], args.daemons)
                swarm.stream(0, prompt=PROMPT, max_tokens=4)
            say(f"kill -9 of a stage ({k + 1} of {args.kills}, {name})")
            runs.append(recovery(swarm, args.tokens, args.kill_after) | {"reload": name})
            say(json.dumps(runs[-1]))
    finally:
        for swarm in swarms.values():
            swarm.stop()
    return {"runs": runs, "median": {name: medians([r for r in runs if r["reload"] == name]) for name in swarms}}


def code_runs(base: Path, bench_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`--kills` kills alternating between a swarm running this code with a graph cache of its own and one
    running the code of `args.compare_code`; both swarms run all along, so that the two see the same load."""
    from scripts.bench_cold_start import checkout

    tree = checkout(args.compare_code, base / "before-code")
    os.environ["SWARMD_GRAPH_CACHE"] = str(base / "graphs")  # this code's daemons; the other code has none
    swarms = {"graph_cache": FaultSwarm(base / "now", bench_file, args.daemons, extra=("--max-context", "256")),
              "before": FaultSwarm(base / "before", bench_file, args.daemons, extra=("--max-context", "256"))}
    for d in swarms["before"].daemons:  # `swarmd join` from the other tree, whatever PYTHONPATH says
        d.command = lambda: [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
                             "from swarmd.cli.main import main; sys.exit(main())", str(tree), "join"]
    runs: list[dict[str, Any]] = []
    try:
        for name, swarm in swarms.items():
            say(f"starting {args.daemons} daemons ({name})")
            swarm.start()
            swarm.stream(0, prompt=PROMPT, max_tokens=4)  # warm every stage's kernels (and graphs)
        for k in range(args.kills):
            name = list(swarms)[k % 2]
            swarm = swarms[name]
            if k >= 2:
                restore(swarm, runs[k - 2]["victim"], args.daemons)
                swarm.stream(0, prompt=PROMPT, max_tokens=4)
            say(f"kill -9 of a stage ({k + 1} of {args.kills}, {name})")
            runs.append(recovery(swarm, args.tokens, args.kill_after) | {"code": name, "first": k < 2})
            say(json.dumps(runs[-1]))
    finally:
        for swarm in swarms.values():
            swarm.stop()
    return {"runs": runs, "median": {
        "graph_cache_first_kill": medians([r for r in runs if r["code"] == "graph_cache" and r["first"]]),
        "graph_cache_later_kills": medians([r for r in runs if r["code"] == "graph_cache" and not r["first"]]),
        "before": medians([r for r in runs if r["code"] == "before"])}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--daemons", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--kill-after", type=int, default=8)
    p.add_argument("--reset-rates", default="0,0.01,0.05")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kills", type=int, default=1,
                   help="recoveries to measure (the killed daemon is started again between them); medians")
    p.add_argument("--standby", type=int, default=0, metavar="N",
                   help="N more daemons join as spares (--standby); the stage a spare holds a copy of is killed")
    p.add_argument("--compare-rebuild", action="store_true",
                   help="with --standby: alternate the kills between requests that move with the hop-local KV "
                        "rebuild and with a full replay (headed by a daemon started with --full-replay)")
    p.add_argument("--compare-reload", action="store_true",
                   help="no standby: alternate the kills between a swarm whose survivors keep the blocks they hold "
                        "and one started with --full-reload (they read their whole new range)")
    p.add_argument("--compare-code", metavar="REV",
                   help="no standby: alternate the kills between a swarm running this code (with a graph cache of "
                        "its own, empty at the start) and one running the code of revision REV")
    p.add_argument("--long-prompt", action="store_true", help="a prompt of about 130 tokens instead of 9")
    p.add_argument("--skip-kill", action="store_true")
    p.add_argument("--skip-resets", action="store_true")
    p.add_argument("--expert-node", action="store_true",
                   help="measure kill -9 of an expert-only node of a MoE swarm instead (with and without replicas)")
    args = p.parse_args()
    results: dict[str, Any] = {"command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="swarmd-faults-") as tmp:
        base = Path(tmp)
        from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

        device = resolve_device("auto")
        load_or_measure(base, device, device_name(device))
        if args.expert_node:
            from tests.moe.moe_swarm import write_tiny_moe

            model = write_tiny_moe(base / "tiny-moe.gguf")
            results["expert_node"] = {
                "with_replicas": expert_node_runs(base / "replicas", base / BENCH_FILE, model, True, args),
                "without_replicas": expert_node_runs(base / "alone", base / BENCH_FILE, model, False, args)}
            print(json.dumps(results, indent=1))
            return 0
        if args.compare_code:
            results["recovery_by_code"] = code_runs(base, base / BENCH_FILE, args)
            print(json.dumps(results, indent=1))
            return 0
        if args.compare_reload:
            results["recovery_by_reload"] = reload_runs(base, base / BENCH_FILE, args)
            print(json.dumps(results, indent=1))
            return 0
        if args.compare_rebuild and (not args.standby or args.daemons < 3):
            p.error("--compare-rebuild needs --standby and at least 3 daemons (two stages survive the kill)")
        prompt = LONG_PROMPT if args.long_prompt else PROMPT
        swarm = FaultSwarm(base / "swarm", base / BENCH_FILE, args.daemons + args.standby,
                           extra=("--max-context", "256"), standby=args.standby)
        # daemon 0 founds the swarm and leads it; daemon 1 runs a stage the spare holds no copy of (the spare
        # copies the last, largest stage) and heads the full-replay requests
        full_head = 1
        if args.compare_rebuild:
            swarm.options[full_head] = ("--full-replay",)
        try:
            say(f"starting {args.daemons} daemons" + (f" and {args.standby} standby" if args.standby else ""))
            swarm.start()
            swarm.stream(0, prompt=PROMPT, max_tokens=4)  # warm every stage's kernels
            if not args.skip_kill:
                runs = []
                for k in range(args.kills):
                    if k:
                        restore(swarm, runs[-1]["victim"], args.daemons)
                        swarm.stream(0, prompt=PROMPT, max_tokens=4)
                    full = args.compare_rebuild and k % 2 == 1
                    say(f"kill -9 of a stage ({k + 1} of {args.kills})" + (
                        f", {'full replay' if full else 'hop-local rebuild'}" if args.compare_rebuild else ""))
                    runs.append(recovery(swarm, args.tokens, args.kill_after, prompt=prompt,
                                         head=full_head if full else None))
                    say(json.dumps(runs[-1]))
                results["recovery"] = {"runs": runs, "median": medians(runs)}
                if args.compare_rebuild:
                    results["recovery"]["by_rebuild"] = {
                        path: medians([r for r in runs if r["rebuild"] == path]) for path in ("hop_local", "full_replay")}
            if not args.skip_resets:  # on the daemons left; the highest rate last (it may split the swarm)
                spares = swarm.standby_of(swarm.running[0].status()["plan"])
                swarm.wait_chain(len(swarm.running) - len(spares), 300)
                say(f"resets over {len(swarm.running)} daemons")
                results["resets"] = resets(swarm, args.tokens, [float(x) for x in args.reset_rates.split(",")],
                                           args.repeats)
        finally:
            swarm.stop()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
