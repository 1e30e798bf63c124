#!/usr/bin/env python3
"""Pipelines of `swarmd join` processes on GPUs: S stages over G GPUs, against one GPU holding the whole model.

    python3 scripts/bench_gpu_pipeline.py --model random/llama-3.1-8b --layouts 1x1,2x2,4x2 --tokens 32

A layout `SxG` runs S daemons on loopback, daemon i on GPU i*G//S (`CUDA_VISIBLE_DEVICES` per process),
with a plan file splitting the blocks evenly (one stage each) and lossless float32 activations on the TLS
data plane; every daemon captures all its graphs before it reports ready (`--warmup`), so no timed request
waits for the compiler. The model is a seeded one (`models.catalog.seeded`: real shapes, seeded weights) or a GGUF
file, so every layout serves the same weights. A MoE model (`--write-moe 1b` writes one) gets the planner's
plan instead, its experts spread over all daemons (or with their stages: `--expert-placement local`, as for
`random/kimi-k2:8`); its first layout should be 1x1 (one daemon, every expert local). Per layout: greedy decode tokens/s of one request (median of --rounds, from the head's token
times), the per-token breakdown from the stages' step times (compute, stage overhead, hops), aggregate
tokens/s with each --concurrent count, and whether the greedy tokens equal the first layout's. With
`--trace`, one traced request per layout gives the per-token breakdown of `swarmd trace summarize`.
`--deadline` (s) skips the layouts that would start after it. Markdown on stdout, JSON in --json-out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pipeline import PROMPTS, aggregate, decode_rate, generate, step_breakdown  # noqa: E402
from bench_trace import request  # noqa: E402
from local_swarm import LocalSwarm, say  # noqa: E402

from models.catalog.moe_writer import SYNTHETIC_MOE, write_synthetic_moe  # noqa: E402
from planner.layout import ModelLayout  # noqa: E402
from swarmd.observe.trace_summary import breakdown  # noqa: E402

GPU_MEMORY = 64 << 30  # what the planner is told each daemon has: two daemons share an H200's 141 GB
GPU_FLOPS, GPU_BANDWIDTH = 500e12, 4e12


def make_plan_for(layout: ModelLayout, peers: list[str], context: int, max_requests: int, placement: str = "spread"):
    """A dense model: one stage per daemon, blocks split evenly. A MoE: the planner's plan for GPUs of one
    size with experts `placement` ("spread": each daemon a stage, every MoE layer's experts over all daemons;
    "local": each MoE layer's experts with its stage, which runs them inside its graph)."""
    from planner import NodeDescriptor, PlanOptions, make_plan
    from planner.plan import ModelRef, Plan, Stage, stage_actor

    if layout.is_moe:
        nodes = [NodeDescriptor(p, GPU_MEMORY, GPU_MEMORY, flops=GPU_FLOPS, mem_bandwidth=GPU_BANDWIDTH, device="CUDA")
                 for p in peers]
        options = PlanOptions(context_length=context, concurrency=max_requests, expert_placement=placement)
        return make_plan(layout, nodes, epoch=1, options=options)
    bounds = [round(i * layout.n_blocks / len(peers)) for i in range(len(peers) + 1)]
    return Plan(1, ModelRef(layout.name), tuple(Stage(p, (bounds[i], bounds[i + 1]), (stage_actor(i),))
                                                for i, p in enumerate(peers)))


def start(model: str, layout: ModelLayout, stages: int, gpus: int, context: int, max_requests: int,
          device: str, placement: str = "spread") -> LocalSwarm:
    import tempfile

    from swarmd.net.identity import load_or_create_identity, peer_id_of

    base = Path(tempfile.mkdtemp(prefix=f"swarmd-gpu-{stages}x{gpus}-"))
    peers = []
    for i in range(stages):
        (base / f"daemon-{i}").mkdir(parents=True)
        peers.append(peer_id_of(load_or_create_identity(base / f"daemon-{i}")))
    plan = make_plan_for(layout, peers, context, max_requests, placement)
    (base / "plan.json").write_text(plan.dumps())
    if layout.is_moe:
        holders = {p for by in plan.experts.values() for hs in by.values() for p in hs}
        say(f"{stages}x{gpus}: stages {[s.layers for s in plan.stages]}, experts on {len(holders)} daemons")
    swarm = LocalSwarm(stages, model=model, base=base, swarm=f"gpu{stages}x{gpus}",
                       extra=("--device", device, "--max-context", str(context), "--max-requests", str(max_requests),
                              "--warmup", *(("--expert-placement", placement) if layout.is_moe else ())),
                       first_extra=("--plan", str(base / "plan.json")),
                       env_of=lambda i: {"CUDA_VISIBLE_DEVICES": str(i * gpus // stages)})
    try:
        swarm.start(timeout=300)
        swarm.wait_ready(timeout=900)
    except BaseException:
        swarm.stop()
        raise
    return swarm


def run_layout(args: argparse.Namespace, layout: ModelLayout, stages: int, gpus: int) -> dict[str, Any]:
    started = time.monotonic()
    swarm = start(args.model, layout, stages, gpus, args.context, max(args.concurrent_list), args.device,
                  args.expert_placement)
    out: dict[str, Any] = {"layout": f"{stages}x{gpus}", "start_s": time.monotonic() - started, "rates": [],
                           "breakdown": {}, "aggregate": {}, "tokens": None}
    try:
        say(f"{stages}x{gpus}: up in {out['start_s']:.0f} s; warming up")
        generate(swarm.api, PROMPTS[0], 4)
        for c in args.concurrent_list:
            aggregate([swarm.api], c, 4)  # compiles each batch size's graph before anything is timed
        parts: dict[str, list[float]] = {}
        for r in range(args.rounds):
            got = generate(swarm.api, PROMPTS[0], args.tokens)
            out["tokens"] = out["tokens"] or got
            out["rates"].append(decode_rate(got))
            for k, v in step_breakdown(swarm, got["request_id"]).items():
                parts.setdefault(k, []).extend(v)
            say(f"{stages}x{gpus}, round {r + 1}: {out['rates'][-1]:.1f} tok/s")
        out["breakdown"] = {k: statistics.median(v) for k, v in parts.items() if v}
        if args.trace:
            out["trace"] = [r.__dict__ for r in breakdown(request(swarm.api, PROMPTS[0], args.tokens, True)["trace"]).rows]
        for c in args.concurrent_list:
            out["aggregate"][c] = aggregate([swarm.api], c, args.tokens)
            say(f"{stages}x{gpus}: {c} at once {out['aggregate'][c]:.1f} tok/s")
    finally:
        swarm.stop()
    return out


def write_moe(preset: str) -> Path:
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="swarmd-gpu-moe-")) / f"synthetic-moe-{preset}.gguf"
    say(f"writing {out.name}")
    return write_synthetic_moe(out, SYNTHETIC_MOE[preset], 0, vocab=MOE_VOCAB, byte_tokenizer=True,
                               name=f"synthetic-moe-{preset}")


MOE_VOCAB = 49152  # SmolLM2's and the presets' nominal size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random/llama-3.1-8b",
                        help="a seeded model (random/ARCH) or a GGUF file (default: random/llama-3.1-8b)")
    parser.add_argument("--write-moe", choices=sorted(SYNTHETIC_MOE), metavar="PRESET",
                        help="write the synthetic MoE preset (seed 0, a byte-level tokenizer of 49152 tokens) "
                             "to a temporary GGUF and serve it instead of --model")
    parser.add_argument("--expert-placement", choices=("spread", "local"), default="spread",
                        help="a MoE's experts over all daemons, or with their stages (default: spread)")
    parser.add_argument("--layouts", default="1x1,2x2", help="STAGESxGPUS, comma-separated (default: 1x1,2x2)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrent", default="1,4", help="requests at once for the aggregate (default: 1,4)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--device", default="CUDA", help="every daemon's --device (default: CUDA)")
    parser.add_argument("--deadline", type=float, default=0.0, help="seconds; start no layout after it (0: none)")
    parser.add_argument("--trace", action="store_true",
                        help="per layout, one traced request: its per-token breakdown (swarmd trace summarize)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    args.concurrent_list = [int(c) for c in args.concurrent.split(",")]
    if args.write_moe:
        args.model = str(write_moe(args.write_moe))
    from swarmd.daemon.served_model import served_model

    model_layout = served_model(args.model).layout
    t0 = time.monotonic()
    results = []
    for layout in args.layouts.split(","):
        if args.deadline and time.monotonic() - t0 > args.deadline:
            say(f"{layout}: skipped, past the deadline")
            continue
        stages, gpus = (int(x) for x in layout.split("x"))
        results.append(run_layout(args, model_layout, stages, gpus))
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=2))
    base = results[0]
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip().replace("\n", ", ")
    except FileNotFoundError:
        gpu = "none (no nvidia-smi)"
    name = f"synthetic-moe-{args.write_moe}" if args.write_moe else model_layout.name
    print(f"Model {name}; {args.tokens} greedy tokens; GPUs: {gpu}; {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    print("| layout | decode tok/s (rounds) | x first layout | compute / stage overhead / hop per stage, ms | "
          "same greedy tokens | " + " | ".join(f"{c} at once, tok/s" for c in args.concurrent_list) + " | start s |")
    print("|---|---|---|---|---|" + "---|" * len(args.concurrent_list) + "---|")
    for r in results:
        b = r["breakdown"]
        same = r["tokens"]["ids"] == base["tokens"]["ids"]
        print(f"| {r['layout']} | {statistics.median(r['rates']):.1f} ({', '.join(f'{x:.1f}' for x in r['rates'])}) "
              f"| {statistics.median(r['rates']) / statistics.median(base['rates']):.2f} | "
              f"{b.get('compute', 0):.2f} / {b.get('stage_overhead', 0):.2f} / {b.get('hop', 0):.2f} | "
              f"{'yes' if same else 'NO'} | " + " | ".join(f"{r['aggregate'][c]:.1f}" for c in args.concurrent_list)
              + f" | {r['start_s']:.0f} |")
    for r in results:
        if r.get("trace"):
            print(f"\nPer-token breakdown of a traced request on {r['layout']} (median and p95 over its decode steps, ms):\n")
            print("| where | phase | decode median | decode p95 |")
            print("|---|---|---|---|")
            for row in r["trace"]:
                if row["median_ms"] is not None:
                    print(f"| {row['where']} | {row['phase']} | {row['median_ms']:.3f} | {row['p95_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
