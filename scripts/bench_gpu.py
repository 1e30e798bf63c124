#!/usr/bin/env python3
"""swarmd's model code on a GPU, against the hardware and against PyTorch, in one run.

Llama-3.2-1B- and Llama-3.1-8B-shaped `StageModel.random` models (seeded float16 weights, the
releases' shapes): prefill tokens/s for a 512-token prompt and decode tokens/s at batch 1, 8 and 32;
the copy bandwidth measured in the same run, the decode roofline (weight bytes read per step / that
bandwidth) and the fraction of it reached; and a plain PyTorch Llama with a static KV cache (eager,
and replayed as a CUDA graph) on the same shapes as a reference column.

Each part runs in its own subprocess (a clean device and environment each; a failure costs one row):

    python3 scripts/bench_gpu.py --out results/                      # everything, on the GPU
    python3 scripts/bench_gpu.py --archs tiny --engines 'swarmd;torch'  # a small check on any device
    python3 scripts/bench_gpu.py --engines 'swarmd:JIT=2;swarmd:BEAM=2' --archs llama-3.1-8b

Engines are separated by ';'. An engine name may carry environment settings for its process after a
colon (`swarmd:JIT=2,BEAM=2`);
`BENCH_BATCHES=1/8` limits its batch sizes, `BENCH_AB=NAME=VALUE` decodes each batch size with that setting
too, from the same state, before the engine's own (a side-by-side in one process), `BENCH_PROFILE=N` writes one batch-N decode step's
and one prefill's per-kernel device times (tinygrad DEBUG=2) under --out, `BENCH_HOST_PROFILE=N` a cProfile listing of
16 batch-N decode steps on their captured graphs (the host's share of a step; waiting for the device shows in the
driver's calls) under --out, `BENCH_HOST_ARGMAX=1` reads each decode step's logits back and picks the greedy tokens
on the host (as for sampled requests) instead of on the device. `--matvec ARCH` first searches the GPU
matvec kernel's options on ARCH's shapes and hands the best per batch size to the swarmd engines
(models/kernels/matvec.py `SWARMD_MATVEC_OPTS`; `swarmd:SWARMD_MATVEC_OPTS=` keeps tinygrad's heuristics).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEED = 1234
WARM_STEPS = 3
WARM_SECONDS = 2.0  # torch's prefill before it is timed (swarmd's compile runs it longer than that)
HOST_PROFILE_STEPS = 16


def arch_spec(name: str):
    from planner.arch import BUILTIN_ARCHS, ArchSpec

    if name == "tiny":  # a Llama-shaped toy for checks on a CPU
        return ArchSpec("tiny", n_blocks=2, hidden=256, ffn=512, n_heads=8, n_kv_heads=2, head_dim=32, vocab=1024)
    return BUILTIN_ARCHS[name]


def matrix_shapes(arch) -> dict[str, tuple[int, int]]:
    """(out, in) of the matrices a decode step reads, fused as StageModel fuses them."""
    q, kv = arch.n_heads * arch.head_dim, arch.n_kv_heads * arch.head_dim
    return {"qkv": (q + 2 * kv, arch.hidden), "attn_out": (arch.hidden, q), "gate_up": (2 * arch.ffn, arch.hidden),
            "down": (arch.hidden, arch.ffn), "head": (arch.vocab, arch.hidden)}


def decode_weight_bytes(arch, bytes_per_value: int = 2) -> int:
    """Weight bytes one decode step reads: every block matrix, the norms and the head (the embedding
    table gives one row per token, so it is left out)."""
    shapes = matrix_shapes(arch)
    block = sum(o * i for k, (o, i) in shapes.items() if k != "head") + 2 * arch.hidden
    return (arch.n_blocks * block + arch.vocab * arch.hidden + arch.hidden) * bytes_per_value


def median_time(fn, n: int, sync, times: list[float] | None = None) -> float:
    """The median of `n` timed calls of `fn`; each call's time is added to `times` when given."""
    times = [] if times is None else times
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ----- workers (each runs in its own process) -----

def work_facts(args) -> dict:
    """The daemon's view of the device (auto-detected), and copy bandwidth through tinygrad and torch."""
    from tinygrad import Device, Tensor, dtypes

    from swarmd.daemon.descriptor import device_memory, device_name, measure_device, resolve_device

    dev = resolve_device("auto")
    total, free = device_memory(dev)
    bench = measure_device(dev)
    out = {"device": dev, "device_name": device_name(dev), "memory_total": total, "memory_free": free,
           "descriptor_flops": bench.flops, "descriptor_mem_bandwidth": bench.mem_bandwidth}
    probe = "from tinygrad import Tensor; print((Tensor.arange(4) + 1).tolist())"
    for other in ("NV", "CUDA"):
        try:
            done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=90,
                                  env=os.environ | {"DEV": other})
            out[f"probe_{other}"] = done.stdout.strip() or done.stderr.strip().splitlines()[-1][:200]
        except subprocess.TimeoutExpired:
            out[f"probe_{other}"] = "timed out"
    n = args.copy_mib << 20
    src = Tensor.ones(n // 2, dtype=dtypes.half, device=dev).contiguous().realize()
    dst = Tensor.empty(n // 2, dtype=dtypes.half, device=dev).realize()
    dst.assign(src + 1).realize()
    t = median_time(lambda: dst.assign(src + 1).realize(), 20, Device[dev].synchronize)
    out["tinygrad_copy_bytes_s"] = 2 * n / t
    with contextlib.suppress(ImportError):
        import torch

        if torch.cuda.is_available():
            a = torch.empty(n, dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            b.copy_(a)
            out["torch_copy_bytes_s"] = 2 * n / torch_time(lambda: b.copy_(a), 20)
            out["torch"] = torch.__version__
            out["gpu"] = torch.cuda.get_device_name()
    return out


def torch_time(fn, n: int) -> float:
    """Median seconds of fn() by CUDA events."""
    import torch

    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernel_seconds(fn, n: int) -> float:
    """Median device time of fn()'s kernels, timed one by one with events (tinygrad DEBUG=2)."""
    from tinygrad.helpers import Context, GlobalCounters

    times = []
    for _ in range(n):
        with Context(DEBUG=2), contextlib.redirect_stdout(io.StringIO()):
            GlobalCounters.reset()
            fn()
            times.append(GlobalCounters.time_sum_s)
    return statistics.median(times)


def matvec_candidates(rows: int, seeds: list | None = None) -> list[tuple[tuple[str, int, int], ...]]:
    """Options to try: the reduction split over a thread group (GROUP: interleaved, GROUPTOP: chunks),
    vector loads along it (UNROLL), several outputs per block (LOCAL) or per thread (UPCAST). For
    several rows, the best single-row options (`seeds`), with the row axis a grid axis or kept in
    registers (UPCAST), so that each weight is read once for all rows."""
    if rows > 1 and seeds:
        return [tuple(s) + extra for s in seeds for extra in ((), (("UPCAST", 1, min(rows, 8)),))]
    out = []
    for group in ("GROUP", "GROUPTOP"):
        for g in (16, 32, 64):
            for unroll in (4, 8):
                for local, upcast in ((1, 1), (4, 1), (1, 4), (4, 4)):
                    opts = [("UNROLL", 0, unroll), (group, 0, g)]
                    opts += [("LOCAL", 0, local)] if local > 1 else []
                    opts += [("UPCAST", 0, upcast)] if upcast > 1 else []
                    out.append(tuple(opts))
    return out


def time_matvec(kernel, x, ws: list, opts: tuple | None) -> float:
    """Device seconds of one matvec, rotating over the weight copies."""
    turn = iter(range(1 << 30))

    def run() -> None:
        kernel(x, ws[next(turn) % len(ws)], view=(x.shape[1],), opts=opts).realize()

    run()
    return kernel_seconds(run, 2 * len(ws))


def work_matvec(args) -> dict:
    """Time the GPU matvec kernel per option set on the architecture's shapes; best per row count."""
    from tinygrad import Device, Tensor, dtypes
    from tinygrad.codegen.opt import Opt, OptOps

    from models.kernels.matvec import _split_matvec, opts_fit

    arch = arch_spec(args.arch)
    dev = Device.DEFAULT
    shapes = {k: v for k, v in matrix_shapes(arch).items() if k in ("qkv", "down", "gate_up")}
    results: dict = {}
    best: dict[str, list] = {}
    seeds: list = []
    for rows in sorted(args.batches):
        scores: dict[tuple, float] = {}
        for name, (o, i) in shapes.items():
            copies = min(16, max(2, math.ceil(4 * 60e6 / (o * i * 2))))  # rotate past the L2 cache
            ws = [Tensor.randn(o, i, dtype=dtypes.half, device=dev).realize() for _ in range(copies)]
            x = Tensor.randn(rows, i, device=dev).realize()
            cands = [None, *matvec_candidates(rows, seeds)]
            cands = cands[:5] if args.quick else cands
            for cand in cands:
                opts = None if cand is None else tuple(Opt(OptOps[a], b, c) for a, b, c in cand)
                if opts is not None and not opts_fit(opts, (o, rows), (i,)):
                    continue
                try:
                    t = time_matvec(_split_matvec, x, ws, opts)
                except Exception as e:
                    results.setdefault("errors", []).append(f"{rows} {name} {cand}: {str(e).splitlines()[0][:120]}")
                    continue
                gbs = o * i * 2 / t / 1e9
                results.setdefault(str(rows), {}).setdefault(str(cand), {})[name] = round(gbs, 1)
                if cand is not None:
                    scores[cand] = scores.get(cand, 0.0) + t
        counts = {c: len(results.get(str(rows), {}).get(str(c), {})) for c in scores}
        full = sorted((c for c in scores if counts[c] == len(shapes)), key=lambda c: scores[c])
        if rows == 1:
            seeds = full[:6]
        if full:
            winner = min(full, key=lambda c: scores[c])
            best[str(rows)] = [list(o) for o in winner]
            results.setdefault("best", {})[str(rows)] = {"opts": str(winner),
                                                         "gb_s": results[str(rows)][str(winner)]}
            results.setdefault("heuristic", {})[str(rows)] = results[str(rows)].get("None")
    if args.out:
        Path(args.out, "matvec_opts.json").write_text(json.dumps(best))
    return results


def prompt_ids(n: int, vocab: int, offset: int = 0):
    import numpy as np

    return (np.random.default_rng(SEED + offset).integers(0, vocab, n)).astype(np.int64)


def work_swarmd(args) -> dict:
    """StageModel.random on the default device: prefill of a prompt, then decode at each batch size."""
    from tinygrad import Device
    from tinygrad.helpers import JIT

    from models.config import config_from_arch
    from models.stage import StageInput, StageModel

    arch = arch_spec(args.arch)
    steps, prompt, batches = args.steps, args.prompt, args.batches
    if os.environ.get("BENCH_BATCHES"):
        batches = [int(b) for b in os.environ["BENCH_BATCHES"].split("/")]
    max_context = prompt + len(batches) * (WARM_STEPS + steps) + 16
    if os.environ.get("BENCH_HOST_PROFILE"):
        max_context += WARM_STEPS + HOST_PROFILE_STEPS
    t0 = time.perf_counter()
    model = StageModel.random(config_from_arch(arch, max_context), SEED, max_context=max_context,
                              max_requests=max(batches), prefill_chunk=args.prefill_chunk)
    Device[model.device].synchronize()
    out: dict = {"device": model.device, "load_s": time.perf_counter() - t0, "weight_bytes": model.weight_bytes(),
                 "decode_weight_bytes": decode_weight_bytes(arch), "jit": JIT.value}

    def prefill(rid: str, offset: int) -> float:
        model.add_request(rid)
        t = time.perf_counter()
        model.forward([StageInput(rid, 0, prompt_ids(prompt, arch.vocab, offset))])
        return time.perf_counter() - t

    t = time.perf_counter()
    prefill("warm", 99)
    model.free_request("warm")
    out["prefill_compile_s"] = time.perf_counter() - t
    times = []
    for r in range(args.prefill_rounds):
        times.append(prefill(f"p{r}", r))
        model.free_request(f"p{r}")
    out["prefill_s"], out["prefill_times_s"] = statistics.median(times), times
    out["prefill_tok_s"] = prompt / out["prefill_s"]
    rids = [f"r{b}" for b in range(max(batches))]
    for b, rid in enumerate(rids):
        prefill(rid, b)
    tokens = {rid: 1 + b for b, rid in enumerate(rids)}
    pos = dict.fromkeys(rids, prompt)
    # BENCH_AB=NAME=VALUE: each batch size is first decoded with that setting too ("a_" keys), then again from the
    # same tokens and positions (the same KV rows rewritten) with the engine's own: one load, picks compared directly
    ab = dict([os.environ["BENCH_AB"].split("=", 1)]) if os.environ.get("BENCH_AB") else None
    for batch in batches:
        group = rids[:batch]
        start = dict(tokens), dict(pos)
        for prefix, env in ([("a_", ab)] if ab else []) + [("", {})]:
            tokens.update(start[0])
            pos.update(start[1])
            own = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            model._decode_jits.clear()  # built again under this setting
            try:
                decode_batch(model, out, prefix, batch, group, tokens, pos, steps)
            finally:
                for k, v in own.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        if ab:
            out[f"b{batch}_tokens_equal"] = out[f"a_b{batch}_tokens"] == out[f"b{batch}_tokens"]
        if args.out:  # what is measured so far survives a worker cut by its timeout
            Path(args.out, f"swarmd-{args.arch}-{args.tag}.json").write_text(json.dumps(out, default=str))
    if os.environ.get("BENCH_HOST_PROFILE") and args.out:
        group = rids[:int(os.environ["BENCH_HOST_PROFILE"])]
        out["host_profile"] = host_profile(model, group, pos, tokens, Path(args.out, f"host-{args.arch}-{args.tag}.txt"))
    if os.environ.get("BENCH_PROFILE") and args.out:
        group = rids[:int(os.environ["BENCH_PROFILE"])]
        out["profile"] = profile_decode(model, group, pos, tokens, Path(args.out, f"profile-{args.arch}-{args.tag}.txt"))
        out["profile_prefill"] = profile_prefill(model, rids[-1], prompt_ids(prompt, arch.vocab, 7),
                                                 Path(args.out, f"profile-prefill-{args.arch}-{args.tag}.txt"))
    return out


def greedy_step(model, group: list[str], pos: dict, tokens: dict) -> None:
    """One decode step of the requests in `group` together, each fed its last pick; their greedy picks and
    positions advance in `tokens` and `pos`."""
    import numpy as np

    from models.stage import StageInput

    on_host = os.environ.get("BENCH_HOST_ARGMAX") == "1"  # read the logits back and pick on the host
    res = model.forward([StageInput(r, pos[r], np.array([tokens[r]]), greedy=not on_host) for r in group])
    for r, out in zip(group, res, strict=True):
        tokens[r], pos[r] = int(out.argmax() if on_host else out), pos[r] + 1


def decode_batch(model, out: dict, prefix: str, batch: int, group: list[str], tokens: dict, pos: dict,
                 steps: int) -> None:
    """Warm-up steps (graph capture), then `steps` timed decode steps of the requests in `group` together,
    feeding each its greedy pick; the figures go to out under `prefix`."""
    from tinygrad.helpers import JIT

    def step() -> None:
        greedy_step(model, group, pos, tokens)

    t = time.perf_counter()
    try:
        for _ in range(WARM_STEPS):
            step()
    except Exception as e:  # graph capture failed: say why, then decode without graphs
        if JIT.value >= 2:
            raise
        out.setdefault("graph_errors", []).append(f"batch {batch}: {type(e).__name__}: {e}"[:300])
        traceback.print_exc()
        JIT.value = 2
        model._decode_jits.clear()
        out["jit"] = 2
        for _ in range(WARM_STEPS):
            step()
    out[f"{prefix}b{batch}_compile_s"] = time.perf_counter() - t
    step_times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - t)
    out[f"{prefix}b{batch}_step_s"] = statistics.median(step_times)
    out[f"{prefix}b{batch}_tok_s"] = batch / out[f"{prefix}b{batch}_step_s"]
    out[f"{prefix}b{batch}_tokens"] = [tokens[r] for r in group]  # greedy picks so far


def host_profile(model, group: list[str], pos: dict, tokens: dict, path: Path, steps: int = HOST_PROFILE_STEPS) -> dict:
    """`steps` decode steps of the requests in `group` (graphs captured first) under cProfile, each fed its greedy
    pick; the listing by own time goes to `path`."""
    import cProfile
    import pstats

    for _ in range(WARM_STEPS):
        greedy_step(model, group, pos, tokens)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        greedy_step(model, group, pos, tokens)
    prof.disable()
    step_s = (time.perf_counter() - t) / steps
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    path.write_text(f"batch {len(group)}: {step_s * 1e3:.2f} ms a step under the profiler\n{buf.getvalue()}")
    return {"batch": len(group), "steps": steps, "step_s": step_s}


def profile_decode(model, group: list[str], pos: dict, tokens: dict, path: Path) -> dict:
    """One decode step of the requests in `group` run eagerly with every kernel timed; the log and a summary by
    kernel name."""
    import numpy as np

    from models.stage import StageInput

    def step(ahead: int) -> None:
        model.forward([StageInput(r, pos[r] + ahead, np.array([tokens[r]])) for r in group])

    return profiled(model, step, path)


def profile_prefill(model, rid: str, prompt, path: Path) -> dict:
    """One prefill of `prompt` as request `rid` (its cache is overwritten) run eagerly with every kernel timed,
    as `profile_decode`."""
    from models.stage import StageInput

    def step(_ahead: int) -> None:
        model.forward([StageInput(rid, 0, prompt)])

    return profiled(model, step, path)


def kernel_times(text: str) -> list[tuple[str, float]]:
    """Each kernel's (name, device seconds), in order, from what tinygrad prints with DEBUG=2."""
    out = []
    for line in text.splitlines():
        m = re.search(r"\s(\S+)\s+arg\s.*\btm\s+([\d.]+)(us|ms|s)", re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m:
            out.append((m.group(1), float(m.group(2)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(3)]))
    return out


def profiled(model, step, path: Path) -> dict:
    """`step(0)` to compile, then `step(1)` with every kernel timed (tinygrad DEBUG=2, no jit)."""
    from tinygrad.helpers import Context, GlobalCounters

    buf = io.StringIO()
    with Context(DEBUG=2, JIT=0), contextlib.redirect_stdout(buf):
        model._decode_jits.clear()
        model._prefill_jits.clear()
        step(0)
        GlobalCounters.reset()
        mark = len(buf.getvalue())
        step(1)
    model._decode_jits.clear()
    model._prefill_jits.clear()
    text = buf.getvalue()
    path.write_text(text)
    by_name: dict[str, list[float]] = {}
    for name, seconds in kernel_times(text[mark:]):
        by_name.setdefault(name, []).append(seconds)
    top = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:15]
    return {"kernel_s": GlobalCounters.time_sum_s, "kernels": sum(len(v) for v in by_name.values()),
            "top": [[k, n, round(s * 1e6, 1)] for s, n, k in top]}


def work_torch(args) -> dict:
    """A plain PyTorch Llama (float16, static KV cache, SDPA) on the same shapes: eager and as a CUDA graph."""
    import torch
    import torch.nn.functional as F

    arch = arch_spec(args.arch)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.float16 if dev == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(SEED)
    h, nh, nkv, hd, L = arch.hidden, arch.n_heads, arch.n_kv_heads, arch.head_dim, arch.n_blocks
    q_dim, kv_dim = nh * hd, nkv * hd
    steps, prompt, batches = args.steps, args.prompt, args.batches
    ctx = prompt + len(batches) * (WARM_STEPS + steps) + 16
    bmax = max(batches)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) / math.sqrt(shape[-1])).to(dt)

    t0 = time.perf_counter()
    layers = [{"wqkv": rand(q_dim + 2 * kv_dim, h), "wo": rand(h, q_dim), "wgu": rand(2 * arch.ffn, h),
               "wd": rand(h, arch.ffn), "an": torch.ones(h, device=dev, dtype=dt),
               "fn": torch.ones(h, device=dev, dtype=dt)} for _ in range(L)]
    embed, head, on = rand(arch.vocab, h), rand(arch.vocab, h), torch.ones(h, device=dev, dtype=dt)
    cache = torch.zeros(L, 2, bmax, nkv, ctx, hd, device=dev, dtype=dt)
    inv = 1.0 / (500000.0 ** (torch.arange(0, hd // 2, device=dev, dtype=torch.float32) * 2 / hd))
    ang = torch.arange(ctx, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    if dev == "cuda":
        torch.cuda.synchronize()
    out: dict = {"device": dev, "torch": torch.__version__, "load_s": time.perf_counter() - t0}

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt) * w

    def rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def forward(tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) of requests 0..B-1 starting at pos (B,): logits of each one's last token."""
        B, T = tokens.shape
        x = embed[tokens]
        p = pos[:, None] + torch.arange(T, device=dev)[None, :]  # (B, T)
        c, s = cos[p][:, None], sin[p][:, None]  # (B, 1, T, hd/2)
        valid = torch.arange(ctx, device=dev)[None, None, :] <= p[:, :, None]  # (B, T, ctx): causal
        mask = valid[:, None]
        bidx = torch.arange(B, device=dev)[:, None].expand(B, T)
        for li, w in enumerate(layers):
            qkv = rms(x, w["an"]) @ w["wqkv"].T
            q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
            q = rope(q.view(B, T, nh, hd).transpose(1, 2), c, s)
            k = rope(k.view(B, T, nkv, hd).transpose(1, 2), c, s)
            v = v.view(B, T, nkv, hd).transpose(1, 2)
            cache[li, 0][bidx, :, p] = k.transpose(1, 2)
            cache[li, 1][bidx, :, p] = v.transpose(1, 2)
            att = F.scaled_dot_product_attention(q, cache[li, 0, :B], cache[li, 1, :B], attn_mask=mask,
                                                 enable_gqa=True)
            x = x + att.transpose(1, 2).reshape(B, T, q_dim) @ w["wo"].T
            g, u = (rms(x, w["fn"]) @ w["wgu"].T).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ w["wd"].T
        return rms(x[:, -1], on) @ head.T

    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    with torch.inference_mode():
        ids = torch.tensor(prompt_ids(prompt, arch.vocab), device=dev)[None]
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        warm_until = time.perf_counter() + WARM_SECONDS  # the GPU's clocks rise under load: time them risen
        while time.perf_counter() < warm_until:
            forward(ids, zero)
            sync()
        out["prefill_times_s"] = []
        out["prefill_s"] = median_time(lambda: forward(ids, zero), args.prefill_rounds, sync, out["prefill_times_s"])
        out["prefill_tok_s"] = prompt / out["prefill_s"]
        for batch in batches:
            tok = torch.ones(batch, 1, dtype=torch.long, device=dev)
            pos = torch.full((batch,), prompt, dtype=torch.long, device=dev)
            forward(tok, pos)
            out[f"b{batch}_eager_step_s"] = median_time(lambda tok=tok, pos=pos: forward(tok, pos), steps, sync)
            out[f"b{batch}_eager_tok_s"] = batch / out[f"b{batch}_eager_step_s"]
            if dev != "cuda":
                continue
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARM_STEPS):
                    forward(tok, pos)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = forward(tok, pos)

            def replay(tok=tok, pos=pos, graph=graph, logits=logits) -> None:
                graph.replay()
                tok.copy_(logits.argmax(-1, keepdim=True))
                pos.add_(1)

            replay()
            out[f"b{batch}_tok_s"] = batch / torch_time(replay, steps)
    return out


WORKERS = {"facts": work_facts, "matvec": work_matvec, "swarmd": work_swarmd, "torch": work_torch}


# ----- the driver -----

def spawn(argv: list[str], env_extra: dict[str, str], timeout: float, log: Path | None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | env_extra, timeout=timeout, cwd=ROOT)
        stdout, stderr, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stderr, rc = (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace"), -9
    if log is not None:
        with log.open("a") as f:
            f.write(f"==== {' '.join(argv)} {env_extra} rc={rc} {time.perf_counter() - t:.1f}s\n{stdout}\n{stderr}\n")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        tail = (stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"rc={rc}: {tail[:300]}", "wall_s": time.perf_counter() - t}
    return json.loads(lines[-1]) | {"wall_s": round(time.perf_counter() - t, 1)}


def parse_engine(spec: str) -> tuple[str, dict[str, str]]:
    name, _, env = spec.partition(":")
    return name, dict(kv.split("=", 1) for kv in env.split(",") if kv)


def report(facts: dict, rows: list[dict], batches: list[int]) -> str:
    bw = facts.get("torch_copy_bytes_s") or facts.get("tinygrad_copy_bytes_s") or float("nan")
    lines = [f"device {facts.get('device')} ({facts.get('device_name')}), "
             f"{facts.get('memory_total', 0) / 2**30:.1f} GiB; copy bandwidth torch "
             f"{facts.get('torch_copy_bytes_s', float('nan')) / 1e12:.2f} TB/s, tinygrad "
             f"{facts.get('tinygrad_copy_bytes_s', float('nan')) / 1e12:.2f} TB/s (read + write)"]
    head = f"{'arch':14} {'engine':28} {'prefill tok/s':>13}" + "".join(
        f" {f'b{b} tok/s':>10} {'%roof':>6}" for b in batches)
    lines += [head, "-" * len(head)]
    for r in rows:
        arch = arch_spec(r["arch"])
        roof = bw / decode_weight_bytes(arch)
        if "error" in r:
            lines.append(f"{r['arch']:14} {r['engine']:28} {r['error']}")
            continue
        cells = ""
        for b in batches:
            v = r.get(f"b{b}_tok_s")
            cells += f" {v:10.1f} {100 * v / (b * roof):5.1f}%" if v else f" {'-':>10} {'-':>6}"
        lines.append(f"{r['arch']:14} {r['engine']:28} {r.get('prefill_tok_s', float('nan')):13.0f}{cells}")
        if any(f"b{b}_eager_tok_s" in r for b in batches):
            cells = "".join(f" {r.get(f'b{b}_eager_tok_s', float('nan')):10.1f} {'':>6}" for b in batches)
            lines.append(f"{r['arch']:14} {r['engine'] + ' (eager)':28} {'':13}{cells}")
    for a in sorted({r["arch"] for r in rows}):
        arch = arch_spec(a)
        lines.append(f"roofline {a}: {decode_weight_bytes(arch) / 1e9:.2f} GB of weights per decode step -> "
                     f"{bw / decode_weight_bytes(arch):.0f} steps/s at {bw / 1e12:.2f} TB/s")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--engines", default="swarmd;torch")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--prefill-rounds", type=int, default=10, help="timed prefills of the prompt (their median counts)")
    p.add_argument("--copy-mib", type=int, default=2048)
    p.add_argument("--matvec", default="", help="search matvec options on this arch's shapes first")
    p.add_argument("--quick", action="store_true", help="a few matvec candidates only (checks)")
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--out", default="")
    p.add_argument("--no-facts", dest="facts", action="store_false",
                   help="skip the device facts and copy bandwidth (no roofline column)")
    p.add_argument("--worker", default="")
    p.add_argument("--arch", default="")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args), default=str))
        return

    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    log = out / "bench_gpu.log" if out else None
    common = ["--batches", ",".join(map(str, args.batches)), "--prompt", str(args.prompt), "--steps", str(args.steps),
              "--prefill-chunk", str(args.prefill_chunk),
              "--prefill-rounds", str(args.prefill_rounds), "--copy-mib", str(args.copy_mib)] + \
             (["--out", str(out)] if out else []) + (["--quick"] if args.quick else [])
    facts = spawn(["--worker", "facts", *common], {}, args.timeout, log) if args.facts else {}
    print("facts", json.dumps(facts), flush=True)
    results: dict = {"facts": facts, "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "runs": []}
    if args.matvec:
        mv = spawn(["--worker", "matvec", "--arch", args.matvec, *common], {}, args.timeout, log)
        print("matvec", json.dumps({k: mv.get(k) for k in ("best", "heuristic", "error")}), flush=True)
        results["matvec"] = mv
    for arch in args.archs.split(","):
        for spec in args.engines.split(";"):
            name, env = parse_engine(spec)
            if name == "swarmd" and out and (out / "matvec_opts.json").exists() and "SWARMD_MATVEC_OPTS" not in env:
                env = env | {"SWARMD_MATVEC_OPTS": str(out / "matvec_opts.json")}
            tag = re.sub(r"[^A-Za-z0-9_.-]", "_", spec.replace("=", ""))  # a file name's part
            row = spawn(["--worker", name, "--arch", arch, "--tag", tag, *common], env, args.timeout, log)
            row |= {"arch": arch, "engine": spec}
            print("run", json.dumps(row), flush=True)
            results["runs"].append(row)
            if out:
                (out / "bench_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print(report(facts, results["runs"], args.batches))


if __name__ == "__main__":
    main()
