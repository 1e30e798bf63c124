#!/usr/bin/env python3
"""Expert parallelism on loopback: fan-out per MoE layer, messages per token, decode rate, expert load.

    .venv/bin/python scripts/bench_moe.py --rounds 3 --tokens 32

* A local swarm of 4 `swarmd join` processes serves `synthetic-moe-small` (8 blocks, the first dense; 16
  routed experts of which 4 per token, sigmoid scores with a selection bias, one shared expert; SmolLM2's
  tokenizer) with the planner's plan, experts spread (`--expert-placement spread`).
* fan-out latency per MoE layer: the median time a router takes for one layer and step (split by node,
  send one batch per node, gather, combine), from the routers' own counters; against the median pipeline
  hop of the same requests (a stage's `sent` to the next stage's `received`, one clock per machine).
* a remote expert call's cost on the wire: after each round's timed request, one traced request; each expert
  batch a router sent to another daemon, its `moe.call` (out -> answer in) minus the expert node's
  `expert.batch` (received -> answer ready), against the hop. A traced request's steps take the event loop's
  path, not the hot lane: an upper bound for the untraced steps.
* messages per token per MoE layer: the routers' ExpertBatch frames per layer call at batch 1 (= per
  token), against the distinct nodes hit (the same, by construction) and top-k.
* decode tokens/s: the swarm (one greedy request at a time through `/api/v0/generate`) against the same
  model whole in this process (`models.generate`, the loop of `swarmd run`), interleaved per round.
* expert load balance on a real prompt set: SmolLM2-MoE 8x2 (a real router: see models/catalog/moe_writer.py) run
  in this process over the prompts; per MoE layer, the most and least loaded expert against the mean.
* `--baseline DIR`: a second swarm of 4 whose daemons run the code of another checkout (DIR), with a plan of the
  same shape, measured in the same rounds: the code before and after, side by side.

Results go to stdout as a Markdown section for docs/BENCHMARKS.md (and as JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pipeline import PROMPTS, decode_rate, generate  # noqa: E402
from local_swarm import LocalSwarm, say  # noqa: E402

MODEL = "synthetic-moe-small"
N_DAEMONS = 4


def start_swarm(model: str, context: int, name: str = "benchmoe", env_of: Any = None) -> LocalSwarm:
    from planner import NodeDescriptor, PlanOptions, make_plan
    from swarmd.daemon.served_model import served_model
    from swarmd.net.identity import load_or_create_identity, peer_id_of

    base = Path(tempfile.mkdtemp(prefix="swarmd-bench-moe-"))
    peers = []
    for i in range(N_DAEMONS):
        home = base / f"daemon-{i}"
        home.mkdir(parents=True)
        peers.append(peer_id_of(load_or_create_identity(home)))
    layout = served_model(model).layout
    options = PlanOptions(context_length=context, concurrency=4, expert_placement="spread")
    plan = make_plan(layout, [NodeDescriptor(p, 8 << 30, 8 << 30) for p in peers], epoch=1, options=options)
    (base / "plan.json").write_text(plan.dumps())
    holders = {p for by in plan.experts.values() for hs in by.values() for p in hs}
    say(f"plan: stages {[s.layers for s in plan.stages]}, experts on {len(holders)} of {N_DAEMONS} daemons")
    extra = ("--max-context", str(context), "--expert-placement", "spread")
    swarm = LocalSwarm(N_DAEMONS, model=model, base=base, extra=extra, swarm=name, env_of=env_of,
                       first_extra=("--plan", str(base / "plan.json")))
    swarm.start()
    swarm.wait_ready()
    return swarm


def hops_ms(swarm: LocalSwarm, request_id: str) -> list[float]:
    """Each pipeline hop of the request's decode steps: a stage's `sent` to the next stage's `received`
    (the last stage's token to stage 0's next step), stages in chain order (not daemon order)."""
    stages = []
    for d in swarm.daemons:
        stage = httpx.get(f"{d.api}/api/v0/pipeline", timeout=10).json()["stage"]
        steps = {s["step"]: s for s in stage["recent_steps"] if s["request_id"] == request_id and s["rows"] == 1}
        stages.append((stage["hop"], steps))
    chain = [steps for _, steps in sorted(stages, key=lambda hs: hs[0])]
    out = []
    for step in sorted(chain[0]):
        if step + 1 not in chain[0] or not all(step in by_step for by_step in chain):
            continue
        for i, by_step in enumerate(chain):
            nxt = chain[i + 1][step] if i + 1 < len(chain) else chain[0][step + 1]
            out.append((nxt["received"] - by_step[step]["sent"]) * 1e3)
    return out


def expert_compute(swarm: LocalSwarm) -> tuple[float, int]:
    """The expert actors' compute so far (all daemons together): ms, batches."""
    ms, batches = 0.0, 0
    for d in swarm.daemons:
        expert = httpx.get(f"{d.api}/api/v0/pipeline", timeout=10).json()["moe"]["expert"]
        ms, batches = ms + expert["compute_ms"], batches + expert["batches"]
    return ms, batches


def mean_compute_ms(now: tuple[float, int], before: tuple[float, int]) -> float:
    """Mean time an expert actor's shard computed one batch between two `expert_compute` readings."""
    batches = now[1] - before[1]
    return (now[0] - before[0]) / batches if batches else float("nan")


def remote_calls_ms(api: str, prompt: str, tokens: int) -> list[tuple[float, float]]:
    """One traced greedy request: for each expert batch a router sent to another daemon, (the router's call:
    batch out -> answer in, the expert node's handling of it: received -> answer ready), in ms, paired by flow id."""
    with httpx.stream("POST", f"{api}/api/v0/generate", timeout=httpx.Timeout(30, read=900),
                      json={"prompt": prompt, "max_tokens": tokens, "trace": True}) as r:
        done = [e for e in map(json.loads, r.iter_lines()) if e["event"] in ("done", "error")][-1]
    if done["event"] != "done":
        raise RuntimeError(f"{done['code']}: {done['message']}")
    spans: dict[str, dict[int, float]] = {"moe.call": {}, "expert.batch": {}}
    for e in done["trace"]:
        if e.get("ph") == "X" and e["name"] in spans and "flow" in e.get("args", {}):
            spans[e["name"]][e["args"]["flow"]] = e["dur"] / 1e3
    calls, handled = spans["moe.call"], spans["expert.batch"]
    return [(calls[f], handled[f]) for f in calls if f in handled]


def medians(swarm: LocalSwarm) -> tuple[list[float], list[float]]:
    """Each daemon's median hot remote call (a batch out -> its answer in, at its routers) and median expert batch
    compute (at its expert actor), over their recent ones; daemons with none left out."""
    calls, computes = [], []
    for d in swarm.daemons:
        moe = httpx.get(f"{d.api}/api/v0/pipeline", timeout=10).json()["moe"]
        if moe["router"].get("hot_call_ms_median") is not None:
            calls.append(moe["router"]["hot_call_ms_median"])
        if moe["expert"].get("compute_ms_median") is not None:
            computes.append(moe["expert"]["compute_ms_median"])
    return calls, computes


def router_layers(swarm: LocalSwarm) -> dict[str, dict[str, Any]]:
    out = {}
    for d in swarm.daemons:
        out.update(httpx.get(f"{d.api}/api/v0/pipeline", timeout=10).json()["moe"]["router"]["layers"])
    return out


class SingleProcess:
    """The whole model in this process, experts in its own graph: `swarmd run`'s loop."""

    def __init__(self, model: str, context: int) -> None:
        from models.catalog.names import resolve_model
        from models.stage import StageModel
        from models.text.tokenizer import Tokenizer

        path = resolve_model(model).path
        self.stage = StageModel.from_gguf(path, max_context=context, max_requests=1)
        self.tokenizer = Tokenizer.from_gguf(path)

    def decode_rate(self, prompt: str, tokens: int) -> float:
        from models.generate import generate as run_generate
        from models.sampling import SamplingParams

        gen = run_generate(self.stage, self.tokenizer, self.tokenizer.encode(prompt),
                           SamplingParams(max_tokens=tokens, stop=()))
        for _ in gen:
            pass
        return gen.stats.decode_tok_s


def load_balance(prompts: tuple[str, ...], tokens: int) -> dict[str, Any]:
    """SmolLM2-MoE 8x2 over the prompts (greedy), its experts counted per MoE layer."""
    from models.catalog.names import resolve_model
    from models.expert_shard import ExpertShard
    from models.stage import StageInput, StageModel
    from models.text.tokenizer import Tokenizer
    from swarmd.inference.moe.dispatch import tokens_per_expert

    path = resolve_model("smollm2-moe-8x2").path
    tok = Tokenizer.from_gguf(path)
    stage = StageModel.from_gguf(path, max_context=256, max_requests=1, local_experts=False)
    shard = ExpertShard.from_gguf(path, {i: range(8) for i in range(stage.config.num_blocks)})
    counts = np.zeros((stage.config.num_blocks, 8), np.int64)

    def experts(call):
        for e, n in tokens_per_expert(call).items():
            counts[call.layer, e] += n
        return shard(call)

    for i, text in enumerate(prompts):
        rid = f"p{i}"
        ids = np.asarray(tok.encode(text))
        stage.add_request(rid)
        logits = stage.forward([StageInput(rid, 0, ids)], experts=experts)[0]
        for t in range(tokens):
            nxt = int(np.argmax(logits))
            logits = stage.forward([StageInput(rid, len(ids) + t, np.array([nxt]))], experts=experts)[0]
        stage.free_request(rid)
    mean = counts.mean(axis=1, keepdims=True)
    return {"rows_per_layer": int(counts[0].sum() // 2), "max_over_mean": (counts.max(axis=1) / mean[:, 0]).tolist(),
            "min_over_mean": (counts.min(axis=1) / mean[:, 0]).tolist(), "counts": counts.tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--balance-tokens", type=int, default=16, help="greedy tokens per prompt for the load balance")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--baseline", type=Path, help="also a swarm running the code of this checkout")
    args = ap.parse_args()

    from models.catalog.names import resolve_model
    from swarmd.inference.compute import use_a_kernel_cache_connection_per_thread

    use_a_kernel_cache_connection_per_thread()
    resolve_model(MODEL)  # written into the cache once, before the daemons look for it
    results: dict[str, Any] = {"single": [], "swarm": [], "hop_ms": [], "fan_out_ms": {}, "messages": {},
                               "baseline": [], "baseline_hop_ms": [], "calls": []}
    swarm = start_swarm(MODEL, args.context)
    base = None
    try:
        if args.baseline:
            env = {"PYTHONPATH": str(args.baseline.resolve()), "PYTHONSAFEPATH": "1"}
            base = start_swarm(MODEL, args.context, "benchmoebase", env_of=lambda i: env)
            generate(base.api, PROMPTS[0], 4)
        generate(swarm.api, PROMPTS[0], 4)  # warm-up: kernels compile, jits capture
        warm = {"": expert_compute(swarm), "baseline_": expert_compute(base) if base is not None else (0.0, 0)}
        single = SingleProcess(MODEL, args.context)
        single.decode_rate(PROMPTS[0], 4)
        for r in range(args.rounds):
            prompt = PROMPTS[r % len(PROMPTS)]
            results["single"].append(single.decode_rate(prompt, args.tokens))
            for which, sw in ((("swarm", swarm), ("baseline", base)) if r % 2 == 0 else
                              (("baseline", base), ("swarm", swarm))):
                if sw is None:
                    continue
                run = generate(sw.daemons[r % N_DAEMONS].api, prompt, args.tokens)
                results[which].append(decode_rate(run))
                results["hop_ms" if which == "swarm" else "baseline_hop_ms"] += hops_ms(sw, run["request_id"])
                if which == "swarm":
                    results["calls"] += remote_calls_ms(sw.daemons[r % N_DAEMONS].api, prompt, args.tokens)
            say(f"round {r + 1}: single {results['single'][-1]:.1f} tok/s, swarm {results['swarm'][-1]:.1f} tok/s"
                + (f", baseline {results['baseline'][-1]:.1f} tok/s" if base is not None else ""))
        for key, sw in (("", swarm), ("baseline_", base)):
            if sw is None:
                continue
            for block, layer in sorted(router_layers(sw).items(), key=lambda kv: int(kv[0])):
                results[key + "fan_out_ms"] = results.get(key + "fan_out_ms", {})
                results[key + "fan_out_ms"][block] = layer["fan_out_ms_median"]
                if not key:
                    results["messages"][block] = {"per_call": layer["messages"] / layer["calls"],
                                                  "nodes_per_call": layer["nodes_per_call"], "calls": layer["calls"],
                                                  "tokens": layer["tokens"]}
            results[key + "expert_compute_ms"] = mean_compute_ms(expert_compute(sw), warm[key])
            results[key + "hot_call_ms"], results[key + "compute_ms"] = medians(sw)
        results["plan"] = swarm.daemons[0].status()["plan"]
    finally:
        swarm.stop()
        if base is not None:
            base.stop()
    results["balance"] = load_balance(PROMPTS, args.balance_tokens)
    results["top_k"] = 4  # synthetic-moe-small
    if args.json:
        print(json.dumps(results, indent=2))
    report(results, args)
    return 0


def _remote_rows(calls: list[tuple[float, float]], hop: float) -> str:
    """Table rows of the traced requests' expert batches sent to other daemons (`remote_calls_ms`). A traced
    request's steps leave the hot lane: these calls take the event loop's path."""
    if not calls:
        return "| expert batches to other daemons in the traced requests (the event loop's path) | none |\n"
    med = statistics.median
    wire = med([c - h for c, h in calls])
    return (f"| expert batches to other daemons (traced requests: the event loop's path) | {len(calls)} |\n"
            f"| a remote call: batch out -> answer in (median) | {med([c for c, _ in calls]):.2f} ms |\n"
            f"| of which the expert node's handling (median) | {med([h for _, h in calls]):.2f} ms |\n"
            f"| the rest, both ways on the wire (median of call - handling) | {wire:.2f} ms |\n"
            f"| (call - handling) / hop | {wire / hop:.2f} x |\n")


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    med = statistics.median
    single, swarm = med(res["single"]), med(res["swarm"])
    fan = [v for v in res["fan_out_ms"].values() if v is not None]
    hop = med(res["hop_ms"]) if res["hop_ms"] else float("nan")
    stages = [s["layers"] for s in res["plan"]["stages"]]
    holders = {p for by in res["plan"]["experts"].values() for hs in by.values() for p in hs}
    print(f"""
## Expert parallelism

`{' '.join(['.venv/bin/python', 'scripts/bench_moe.py', *sys.argv[1:]])}` on a 2-core shared x86-64 VM, Python
{platform.python_version()}, {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}.
Model `{MODEL}` on {N_DAEMONS} daemons, stages {stages}, experts spread over {len(holders)} daemons by the planner
(`--expert-placement spread`); top-k {res['top_k']} of 16 experts; {args.rounds} rounds of {args.tokens} greedy tokens.

| figure | value |
| --- | --- |
| fan-out per MoE layer and step (median over layers of each router's median) | {med(fan):.2f} ms |
| one pipeline hop, same requests (median) | {hop:.2f} ms |
| fan-out / hop | {med(fan) / hop:.2f} x |
| an expert batch's compute (mean over the timed and traced requests) | {res['expert_compute_ms']:.2f} ms |
| decode, single process (`models.generate`, whole model) | {single:.1f} tok/s |
| decode, 4 daemons | {swarm:.1f} tok/s ({swarm / single:.2f} x) |
| a remote call on the hot lane, batch out -> answer in (median of medians) | {med(res['hot_call_ms']):.2f} ms |
| an expert batch's compute (median of medians) | {med(res['compute_ms']):.2f} ms |
| **(remote call - compute) / hop** (target 2x) | **{(med(res['hot_call_ms']) - med(res['compute_ms'])) / hop:.2f} x** |
{_remote_rows(res["calls"], hop)}""")
    if res["baseline"]:
        bfan = [v for v in res["baseline_fan_out_ms"].values() if v is not None]
        bhop = med(res["baseline_hop_ms"]) if res["baseline_hop_ms"] else float("nan")
        bswarm = med(res["baseline"])
        print(f"The code before (`--baseline`), same rounds: fan-out {med(bfan):.2f} ms, hop {bhop:.2f} ms "
              f"({med(bfan) / bhop:.2f} x), expert batch {res['baseline_expert_compute_ms']:.2f} ms, decode "
              f"{bswarm:.1f} tok/s ({bswarm / single:.2f} x; rounds {', '.join(f'{x:.1f}' for x in res['baseline'])}); "
              f"this code's rounds {', '.join(f'{x:.1f}' for x in res['swarm'])}, single "
              f"{', '.join(f'{x:.1f}' for x in res['single'])}.\n")
    print("| MoE block | fan-out ms | messages per token | distinct nodes per token | top-k |")
    print("| --- | --- | --- | --- | --- |")
    for block, m in res["messages"].items():
        print(f"| {block} | {res['fan_out_ms'][block]:.2f} | {m['per_call']:.2f} | {m['nodes_per_call']:.2f} "
              f"| {res['top_k']} |")
    bal = res["balance"]
    hi, lo = bal["max_over_mean"], bal["min_over_mean"]
    print(f"""
Expert load, SmolLM2-MoE 8x2 in one process over the {len(PROMPTS)} prompts of `bench_pipeline.py` plus
{args.balance_tokens} greedy tokens each ({bal['rows_per_layer']} rows per MoE layer, each routed to 2 of 8):
most loaded expert / mean: median {med(hi):.2f}, worst {max(hi):.2f} (block {int(np.argmax(hi))}); least
loaded / mean: median {med(lo):.2f}, lowest {min(lo):.2f}.
""")


if __name__ == "__main__":
    raise SystemExit(main())
