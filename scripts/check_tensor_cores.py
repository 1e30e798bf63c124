#!/usr/bin/env python3
"""Prefill logits with and without the tensor-core matmul (SWARMD_TENSOR_CORES=0/1), llama-3.2-1b random weights, on
the default device (a GPU): the largest difference, top-1 agreement per position, the top-1/top-2 gaps where they
disagree. The graph cache is off here: it would hand the second model the first one's graphs.

    python3 scripts/check_tensor_cores.py
"""

from __future__ import annotations

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


def main() -> None:
    from planner.arch import BUILTIN_ARCHS

    os.environ["SWARMD_GRAPH_CACHE"] = "off"
    arch = BUILTIN_ARCHS["llama-3.2-1b"]
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
