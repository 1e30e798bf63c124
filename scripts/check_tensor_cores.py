#!/usr/bin/env python3
"""Prefill logits with and without the tensor-core matmul (SWARMD_TENSOR_CORES=0/1), llama-3.2-1b random weights, on
the default device (a GPU): the largest difference, top-1 agreement per position, the top-1/top-2 gaps where they
disagree. With `--decode B`, the logits of B requests decoded together instead, with the decode batch's products on
the matvec (SWARMD_TENSOR_CORE_MIN_ROWS=64) and on the tensor cores, fed the same tokens (the matvec run's greedy
picks). The graph cache is off here: it would hand the second model the first one's graphs.

    python3 scripts/check_tensor_cores.py
    python3 scripts/check_tensor_cores.py --decode 8 --steps 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prefill_logits(arch, tensor_cores: bool, ids: np.ndarray) -> np.ndarray:
    from models.config import config_from_arch
    from models.stage import StageInput, StageModel

    os.environ["SWARMD_TENSOR_CORES"] = "1" if tensor_cores else "0"  # read as the graphs are built
    model = StageModel.random(config_from_arch(arch, 512), 1234, max_context=512, max_requests=1, prefill_chunk=256)
    model.add_request("r")
    return model.forward([StageInput("r", 0, ids, all_logits=True)])[0]


def decode_logits(arch, min_rows: str, batch: int, steps: int, feed: np.ndarray | None) -> np.ndarray:
    """(steps, batch, vocab) logits of `batch` requests decoded together after 64-token prompts; each step's
    input tokens are `feed`'s (or this run's greedy picks when there is none)."""
    from models.config import config_from_arch
    from models.stage import StageInput, StageModel

    os.environ["SWARMD_TENSOR_CORE_MIN_ROWS"] = min_rows  # read as the graphs are built
    model = StageModel.random(config_from_arch(arch, 512), 1234, max_context=512, max_requests=batch, prefill_chunk=64)
    rng, prompt = np.random.default_rng(0), 64
    tokens = np.zeros(batch, dtype=np.int32)
    for b in range(batch):
        model.add_request(f"r{b}")
        logits = model.forward([StageInput(f"r{b}", 0, rng.integers(0, arch.vocab, prompt).astype(np.int32))])[0]
        tokens[b] = logits.argmax()
    out = []
    for t in range(steps):
        fed = feed[t - 1].argmax(-1) if feed is not None and t else tokens
        res = model.forward([StageInput(f"r{b}", prompt + t, np.array([fed[b]], dtype=np.int32)) for b in range(batch)])
        out.append(np.stack(res))
        tokens = out[-1].argmax(-1)
    return np.stack(out)


def main() -> None:
    from planner.arch import BUILTIN_ARCHS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, default=0, help="compare the decode logits of this many requests at once")
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    os.environ["SWARMD_GRAPH_CACHE"] = "off"
    arch = BUILTIN_ARCHS["llama-3.2-1b"]
    if args.decode:
        a = decode_logits(arch, "64", args.decode, args.steps, None)
        b = decode_logits(arch, "", args.decode, args.steps, a)
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    else:
        ids = np.random.default_rng(0).integers(0, arch.vocab, 256).astype(np.int32)
        a, b = prefill_logits(arch, False, ids), prefill_logits(arch, True, ids)
    ranked = np.sort(a, -1)
    gap = ranked[:, -1] - ranked[:, -2]
    differ = a.argmax(-1) != b.argmax(-1)
    print(json.dumps({"shape": list(a.shape), "max_abs_diff": float(np.abs(a - b).max()),
                      "top1_agree": float((~differ).mean()), "disagree_gaps": sorted(map(float, gap[differ]))[:10],
                      "median_gap": float(np.median(gap))}))


if __name__ == "__main__":
    main()
