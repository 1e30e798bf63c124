#!/usr/bin/env python3
"""Full-width Kimi-K2 blocks on one GPU: decode time per MoE block at batch 1 and 8 against the block's roofline.

`random/kimi-k2:N`'s blocks (models/deepseek2.py KIMI_K2: hidden 7168, 64 heads, MLA 1536/512, 384 experts of
2048, top-8, one shared expert), Q4_0 weights drawn on the device (`models.catalog.seeded_quantized`), as one
`StageModel` of MoE blocks 1..N (no embedding, no head) holding its experts; float numerics (the weights stay in
their Q4_0 blocks, dequantised in the kernels). Two expert paths:

* `in graph`: the routed experts run inside the stage's jitted graph, each (row, expert) pair gathering its
  expert's Q4_0 matrices by index (`ExpertShard.in_graph`): no host round trip per block;
* `shard`: as `swarmd run` and a swarm run it: the graph cut after each router, the stage's own shard answering
  on the host side (`ExpertShard.expert_outputs` + `gated_sum`).

Roofline: the bytes a decode step reads per block (the block's own buffers: MLA projections, norms, router
and selection bias, shared expert; 8 routed experts per row, distinct ones counted once; the latent cache of
every request) over the device-to-device copy rate measured in the same run (torch, bytes read + written).
Before building, the options of the GGML-block kernel are searched on the experts' real shapes.

    python3 scripts/bench_kimi_gpu.py --blocks 12 --batches 1,8 --steps 32 --context 512 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TORCH_COPY = """
import torch, statistics
n = {n}
a = torch.empty(n, dtype=torch.uint8, device='cuda'); b = torch.empty_like(a); b.copy_(a)
ts = []
for _ in range(20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); b.copy_(a); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
print(2 * n / statistics.median(ts), torch.cuda.get_device_name())
"""

CANDIDATES = [  # options of the GGML-block kernel (models.kernels.gathered.block_opts; reduce axis 0: the blocks
    # of 32 of a row; axes 0, 1, 2: slots, output features, rows); the first is the built-in choice
    [["GROUP", 0, 32]], [["GROUP", 0, 16]], [["GROUP", 0, 8]], [["GROUP", 0, 32], ["UPCAST", 1, 2]],
    [["GROUP", 0, 16], ["UPCAST", 1, 4]], [["GROUP", 0, 8], ["UPCAST", 1, 4]], [["GROUP", 0, 8], ["LOCAL", 1, 4]],
    [["GROUP", 0, 16], ["LOCAL", 1, 2]], [["GROUPTOP", 0, 32]], [["GROUP", 0, 4], ["LOCAL", 1, 8]],
]


def say(*a) -> None:
    print(*a, flush=True)


def copy_rate(mib: int) -> tuple[float, str]:
    done = subprocess.run([sys.executable, "-c", TORCH_COPY.format(n=mib << 20)], capture_output=True, text=True,
                          timeout=300)
    rate, name = done.stdout.split(maxsplit=1)
    return float(rate), name.strip()


def free_memory() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60).stdout
    return int(out.split()[0]) << 20


def median_call_s(jit, args: tuple, device: str, n: int) -> float:
    """The median seconds of `n` calls of `jit` on `args`, each waited for, after three untimed ones."""
    from bench_gpu import median_time
    from tinygrad import Device

    for _ in range(3):
        jit(*args)
    return median_time(lambda: jit(*args), n, Device[device].synchronize)


def use_expert_path(stage, in_graph: bool) -> None:
    """The routed experts inside the stage's graph, or the graph cut after each router for the shard."""
    stage.experts_in_graph = in_graph
    stage.segments = stage._cut_segments()


def search_gathered_opts(config, device: str, timeout_s: float) -> tuple[list, list[dict]]:
    """Each candidate's time for one decode's expert work at batch 1 (8 pairs: gate+up, then down), best first."""
    from tinygrad import Tensor, TinyJit

    from models.catalog.seeded_quantized import expert_weights
    from models.expert_shard import _stack_gate_up
    from models.kernels.gathered import gathered_matvec

    w = expert_weights(config, 0, {1: range(config.num_experts)}, device)
    gate_up = _stack_gate_up(w["blk.1.ffn_gate_exps.weight"], w["blk.1.ffn_up_exps.weight"], device)
    down = w["blk.1.ffn_down_exps.weight"]
    x = Tensor.randn(8, 1, config.dim, device=device).realize()
    idx = Tensor(np.arange(8, dtype=np.int32) * 47 % config.num_experts, device=device).realize()
    rows, started = [], time.time()
    for opts in CANDIDATES:
        if time.time() - started > timeout_s:
            break
        os.environ["SWARMD_BLOCK_OPTS"] = json.dumps(opts)

        def step(x: Tensor, idx: Tensor) -> Tensor:
            g, u = gathered_matvec(x, gate_up, idx).chunk(2, dim=-1)
            return gathered_matvec((g.silu() * u).contiguous(), down, idx).realize()

        try:
            rows.append({"opts": opts, "ms": median_call_s(TinyJit(step), (x, idx), device, 20) * 1e3})
        except Exception as e:  # an option the kernel's shape refuses
            rows.append({"opts": opts, "error": f"{type(e).__name__}: {str(e)[:80]}"})
        say("gathered opts", rows[-1])
    ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    return (ok[0]["opts"] if ok else []), rows


DENSE_CANDIDATES = [  # options of a single GGML-block matrix's kernel (axis 1: output features; reduce axis 0)
    [["GROUP", 0, 4], ["LOCAL", 1, 8]], [["GROUP", 0, 8], ["LOCAL", 1, 8]], [["GROUP", 0, 16], ["LOCAL", 1, 8]],
    [["GROUP", 0, 32], ["LOCAL", 1, 8]], [["GROUP", 0, 8], ["LOCAL", 1, 4]], [["GROUP", 0, 16], ["LOCAL", 1, 4]],
    [["GROUP", 0, 32], ["LOCAL", 1, 4]], [["GROUP", 0, 16], ["LOCAL", 1, 2]], [["GROUP", 0, 32], ["LOCAL", 1, 2]],
    [["GROUP", 0, 16]], [["GROUP", 0, 32]],
]


def search_dense_opts(config, device: str) -> list[dict]:
    """Each single GGML-block matrix of a block (the MLA projections, the shared expert), batch 1,
    under each of `DENSE_CANDIDATES`: microseconds a product, and its read rate."""
    from tinygrad import Tensor, TinyJit

    from models.catalog.seeded_quantized import q4_0_matrix
    from models.kernels.gathered import block_matvec

    heads, shared = config.n_heads, config.shared_expert_dim
    shapes = {"q_a + kv_a": (config.q_lora_rank + config.kv_lora_rank + config.rope_dim, config.dim),
              "q_b": (heads * config.head_dim, config.q_lora_rank), "o": (config.dim, heads * config.v_head_dim),
              "shared gate/up": (2 * shared, config.dim), "shared down": (config.dim, shared)}
    rows = []
    for name, (out, width) in shapes.items():
        w = q4_0_matrix(7, name, (out, width), device)
        x = Tensor.randn(1, 1, width, device=device).realize()
        for opts in DENSE_CANDIDATES:
            if (width // 32) % math.prod(arg for op, _, arg in opts if op == "GROUP"):
                continue  # block_opts would fall back to its own options
            os.environ["SWARMD_BLOCK_OPTS"] = json.dumps(opts)
            try:
                us = median_call_s(TinyJit(lambda x, w=w: block_matvec(x, w).realize()), (x,), device, 30) * 1e6
                rows.append({"matrix": name, "shape": [out, width], "opts": opts, "us": us,
                             "gb_s": (w.q.nbytes() + w.d.nbytes()) / us / 1e3})
            except Exception as e:  # an option the kernel's shape refuses
                rows.append({"matrix": name, "opts": opts, "error": f"{type(e).__name__}: {str(e)[:80]}"})
            say("dense opts", json.dumps(rows[-1]))
        os.environ.pop("SWARMD_BLOCK_OPTS", None)
    return rows


def block_bytes(stage, i: int, batch: int, context: int, distinct: float) -> dict[str, float]:
    """Bytes one decode step reads for block i: its own buffers once, `distinct` routed experts, each
    request's latent cache."""
    from tinygrad import nn
    from tinygrad.uop.ops import Ops

    held = {u: u.buffer.nbytes for t in nn.state.get_parameters(stage.blk[i]) for u in t.uop.toposort()
            if u.op is Ops.BUFFER}
    fused = {u: u.buffer.nbytes for t in [stage._qkv[i], *([stage._gate_up[i]] if i in stage._gate_up else [])]
             for u in t.uop.toposort() if u.op is Ops.BUFFER}
    dense = sum((held | fused).values())  # the block's buffers, each once (fused projections are views of one)
    gate_up, down = stage.expert_shard.weights[i]
    per_expert = (gate_up.nbytes() + down.nbytes()) / stage.config.num_experts
    cache = stage.kv.layers[i]
    kv = batch * (context + 1) * cache.shape[-1] * cache.dtype.itemsize
    return {"dense": dense, "experts": distinct * per_expert, "kv": kv, "total": dense + distinct * per_expert + kv,
            "per_expert": per_expert}


def expected_distinct(n: int, k: int, rows: int) -> float:
    """Expected distinct experts among `rows` rows choosing k of n uniformly."""
    return n * (1 - (1 - k / n) ** rows)


def profile_in_graph(stage, config, context: int, batch: int, path: Path) -> dict:
    """One decode step of `batch` requests with the experts in the graph, run eagerly with every kernel timed
    (`bench_gpu.profiled`): the device time by kernel name."""
    from bench_gpu import profiled

    from models.stage import StageInput

    use_expert_path(stage, True)
    rids = [f"profiled{b}" for b in range(batch)]
    for rid in rids:
        stage.add_request(rid)
    x = np.random.default_rng(1).standard_normal((1, config.dim)).astype(np.float32) * 0.1

    def step(_ahead: int) -> None:
        for rid in rids:
            stage.slots.set_length(rid, context)
        stage.forward([StageInput(rid, context, x) for rid in rids])

    try:
        return profiled(stage, step, path)
    finally:
        for rid in rids:
            stage.free_request(rid)


def profiler_range(stage, config, context: int, batches: list[int], steps: int) -> None:
    """`steps` in-graph decode steps per batch, after a warm one, between the CUDA profiler's start and stop."""
    import ctypes

    from models.stage import StageInput

    cuda = ctypes.CDLL("libcuda.so.1")
    use_expert_path(stage, True)
    x = np.random.default_rng(2).standard_normal((1, config.dim)).astype(np.float32) * 0.1
    for batch in batches:
        ids = [f"ncu-{batch}-{b}" for b in range(batch)]
        for rid in ids:
            stage.add_request(rid)
        for n in range(steps + 1):
            for rid in ids:
                stage.slots.set_length(rid, context)
            if n == 1:
                cuda.cuProfilerStart()
            stage.forward([StageInput(rid, context, x) for rid in ids])
        cuda.cuProfilerStop()
        for rid in ids:
            stage.free_request(rid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--copy-mib", type=int, default=2048)
    parser.add_argument("--search-s", type=float, default=60.0, help="0: no search, the kernel's own options")
    parser.add_argument("--search-dense", action="store_true",
                        help="first time each single matrix of a block under candidate kernel options")
    parser.add_argument("--profile", action="store_true",
                        help="then one step in graph run eagerly, every kernel timed (profile-kimi.txt)")
    parser.add_argument("--profile-batch", type=int, default=1, help="the profiled step's requests")
    parser.add_argument("--ncu-steps", type=int, default=0,
                        help="then this many in-graph steps per batch inside cuProfilerStart/Stop, for "
                             "`ncu --profile-from-start off` to time each kernel of the graph")
    parser.add_argument("--too-many", type=int, default=20, help="a block count to show the one-line error for")
    parser.add_argument("--mini", action="store_true", help="kimi-k2-mini's width instead (a dry run on a CPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from tinygrad import Device

    from models.catalog.seeded import parse_seeded_name
    from models.errors import ModelError
    from models.stage import StageInput, StageModel

    t0 = time.time()
    report: dict = {"args": vars(args)}
    rate, gpu = copy_rate(args.copy_mib) if not args.mini else (20e9, "a CPU (dry run)")
    report |= {"copy_bytes_s": rate, "gpu": gpu, "free_memory": free_memory() if not args.mini else 16 << 30}
    say(f"{gpu}: copy {rate / 1e12:.2f} TB/s, {report['free_memory'] / 1e9:.1f} GB free")
    seeded = parse_seeded_name(f"random/kimi-k2:{args.too_many}")
    batches = [int(b) for b in args.batches.split(",")]
    try:
        seeded.check_fits(0, args.too_many, report["free_memory"], args.context + 64, max(batches))
        report["too_many"] = "fits"
    except ModelError as e:
        report["too_many"] = str(e)
    say("asking for too many:", report["too_many"])
    seeded = parse_seeded_name(f"random/kimi-k2:{args.blocks + 2}")
    config = seeded.config(args.context + 64)
    if args.mini:
        from dataclasses import replace

        from models.deepseek2 import KIMI_K2_MINI

        config = replace(KIMI_K2_MINI, n_blocks=args.blocks + 2).config(4096, args.context + 64)
    device = Device.DEFAULT
    if args.search_dense:
        report["dense_search"] = search_dense_opts(config, device)
    if args.search_s > 0:
        best, searched = search_gathered_opts(config, device, args.search_s)
        os.environ["SWARMD_BLOCK_OPTS"] = json.dumps(best)
        report |= {"gathered_search": searched, "gathered_opts": best}
        say(f"searched in {time.time() - t0:.0f} s; using {best}")
    if not args.mini:
        seeded.check_fits(1, 1 + args.blocks, free_memory(), config.max_context, max(batches))
    t = time.time()
    stage = StageModel.random(config, seeded.seed, 1, 1 + args.blocks, max_context=config.max_context,
                              max_requests=max(batches), device=device, numerics="float", experts_in_graph=True)
    report["load_s"] = time.time() - t
    report["weight_bytes"] = stage.weight_bytes()
    say(f"built {args.blocks} blocks in {report['load_s']:.0f} s, {report['weight_bytes'] / 1e9:.1f} GB")
    rng = np.random.default_rng(0)
    rows = []
    for mode in ("in graph", "shard"):
        use_expert_path(stage, mode == "in graph")
        for batch in batches:
            ids = [f"{mode}-{batch}-{b}" for b in range(batch)]
            for rid in ids:
                stage.add_request(rid)
                stage.slots.set_length(rid, args.context)  # decode at this position (the cache's rows are zeros)
            times = []
            t = time.time()
            for _ in range(args.steps + 3):
                items = [StageInput(rid, args.context, rng.standard_normal((1, config.dim)).astype(np.float32) * 0.1)
                         for rid in ids]
                start = time.perf_counter()
                stage.forward(items)
                times.append(time.perf_counter() - start)
                for rid in ids:
                    stage.slots.set_length(rid, args.context)
            for rid in ids:
                stage.free_request(rid)
            step_s = statistics.median(times[3:])
            distinct = min(config.num_experts_per_tok * batch, expected_distinct(config.num_experts, 8, batch))
            need = block_bytes(stage, 1, batch, args.context, distinct)
            per_block = step_s / args.blocks
            roof = need["total"] / rate
            rows.append({"mode": mode, "batch": batch, "step_ms": step_s * 1e3, "block_ms": per_block * 1e3,
                         "roofline_ms": roof * 1e3, "percent": 100 * roof / per_block, "bytes": need,
                         "first_steps_s": sum(times[:3]), "took_s": time.time() - t})
            say(json.dumps(rows[-1]))
    report["rows"] = rows
    if args.ncu_steps:
        profiler_range(stage, config, args.context, batches, args.ncu_steps)
    if args.profile and args.out:
        report["profile"] = profile_in_graph(stage, config, args.context, args.profile_batch,
                                             Path(args.out, "profile-kimi.txt"))
        say("profile", json.dumps(report["profile"]))
    say("| expert path | batch | step (ms) | per block (ms) | bytes per block (MB) | roofline (ms) | % of roofline |")
    say("|---|---|---|---|---|---|---|")
    for r in rows:
        say(f"| {r['mode']} | {r['batch']} | {r['step_ms']:.2f} | {r['block_ms']:.3f} | {r['bytes']['total'] / 1e6:.0f} "
            f"| {r['roofline_ms']:.3f} | {r['percent']:.0f} % |")
    say(f"(total {time.time() - t0:.0f} s)")
    if args.out:
        Path(args.out, "kimi_gpu.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
