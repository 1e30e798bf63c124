"""Prefill logits with and without the tensor-core matmul (SWARMD_TENSOR_CORES=0/1), llama-3.2-1b random weights, on
the default device (a GPU): the largest difference, top-1 agreement per position, the top-1/top-2 gaps where they
disagree. Run from the repository root: `python3 scripts/check_tensor_cores.py`."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.getcwd())
from models.config import config_from_arch
from models.stage import StageInput, StageModel
from planner.arch import BUILTIN_ARCHS

arch = BUILTIN_ARCHS["llama-3.2-1b"]
out = {}
rng = np.random.default_rng(0)
ids = rng.integers(0, arch.vocab, 256).astype(np.int32)
for mode in ("0", "1"):
    os.environ["SWARMD_TENSOR_CORES"] = mode
    m = StageModel.random(config_from_arch(arch, 512), 1234, max_context=512, max_requests=1, prefill_chunk=256)
    m.add_request("r")
    out[mode] = m.forward([StageInput("r", 0, ids, all_logits=True)])[0]
    del m
a, b = out["0"], out["1"]
top_a, top_b = a.argmax(-1), b.argmax(-1)
srt = np.sort(a, -1)
gap = srt[:, -1] - srt[:, -2]
dis = top_a != top_b
print(json.dumps({"shape": list(a.shape), "max_abs_diff": float(np.abs(a - b).max()),
                  "top1_agree": float((~dis).mean()), "disagree_gaps": sorted(map(float, gap[dis]))[:10],
                  "median_gap": float(np.median(gap))}))
