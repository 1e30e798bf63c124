"""What an expert shard's graphs cost: capturing them for every layer it holds, and a call once they are captured.

A shard of `--layers` MoE layers of a catalogue model (every expert held) runs, for each row count, one call per
layer (the first call of a layout captures its graph) and then `--calls` timed calls per layer. Run it from two
checkouts to compare them (`PYTHONPATH=<checkout> python scripts/bench_expert_graphs.py`); the graph cache is
switched off, so every graph is captured in this process.

    python scripts/bench_expert_graphs.py [--model smollm2-moe-8x2] [--layers 12] [--rows 1,2,4] [--calls 20]

Prints one JSON line: the seconds spent in first calls (captures), the graphs held, and the median milliseconds
per call afterwards.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--model", default="smollm2-moe-8x2", help="a MoE model of the catalogue (default smollm2-moe-8x2)")
    p.add_argument("--layers", type=int, default=12, help="MoE layers the shard holds (default 12)")
    p.add_argument("--rows", default="1,2,4", help="row counts per call (default 1,2,4)")
    p.add_argument("--calls", type=int, default=20, help="timed calls per layer and row count (default 20)")
    args = p.parse_args()
    os.environ["SWARMD_GRAPH_CACHE"] = "off"

    from models.catalog.names import resolve_model
    from models.config import config_from_header
    from models.expert_shard import ExpertShard
    from models.gguf.header import read_header
    from models.moe import ExpertCall, is_moe_block
    from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk

    keep_compiled_programs_on_disk()  # as daemons do: kernels come from the disk cache, graphs are captured
    path = resolve_model(args.model).path
    config = config_from_header(read_header(path))
    layers = [b for b in range(config.num_blocks) if is_moe_block(config, b)][:args.layers]
    shard = ExpertShard.from_gguf(path, {b: range(config.num_experts) for b in layers})
    rng = np.random.default_rng(0)
    k = config.num_experts_per_tok
    capture, per_call = 0.0, []
    for rows in (int(r) for r in args.rows.split(",")):
        calls = [ExpertCall(b, rng.standard_normal((rows, config.dim)).astype(np.float32),
                            np.array([[(r * k + j) % config.num_experts for j in range(k)] for r in range(rows)], np.int32),
                            rng.random((rows, k)).astype(np.float32)) for b in layers]
        started = time.perf_counter()
        for call in calls:
            shard(call)
        capture += time.perf_counter() - started
        for _ in range(args.calls):
            started = time.perf_counter()
            for call in calls:
                shard(call)
            per_call.append((time.perf_counter() - started) / len(calls))
    print(json.dumps({"model": args.model, "layers": len(layers), "rows": args.rows, "first_calls_s": round(capture, 3),
                      "graphs": len(shard._jits), "ms_per_call": round(statistics.median(per_call) * 1e3, 3)}))


if __name__ == "__main__":
    main()
