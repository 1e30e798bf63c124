"""One MoE layer's routed experts for a batch of rows, two ways, side by side on one device:

* `ExpertShard.compute` (models/expert_shard.py): the selected (row, expert) pairs laid out per expert, each
  slot's matrices gathered by index inside the kernels (`gathered_matvec`, jitted per layout);
* gathering each row's selected expert matrices (tinygrad.llm's `ExpertWeights`, as `models.moe.routed_experts`
  does inside a stage's graph), jitted the same way.

    python scripts/bench_expert_shard.py [--arch small] [--rows 1,4] [--calls 50] [--rounds 5]

Prints, per row count, the median milliseconds per call of each (interleaved rounds) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="small", help="a synthetic MoE architecture: tiny, small, 1b (default small)")
    p.add_argument("--rows", default="1,4", help="row counts per call (default 1,4)")
    p.add_argument("--calls", type=int, default=50, help="timed calls per round (default 50)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    args = p.parse_args()

    from tinygrad import Tensor, TinyJit
    from tinygrad.llm.model import ExpertWeights

    from models.catalog.moe_writer import SYNTHETIC_MOE
    from models.catalog.synthetic import random_expert_weights
    from models.expert_shard import ExpertShard

    arch = SYNTHETIC_MOE[args.arch]
    config = arch.config(vocab=256)
    layer, experts = arch.leading_dense, list(range(arch.n_experts))
    weights = random_expert_weights(config, 1, {layer: experts})
    shard = ExpertShard(config, dict(weights), {layer: experts})  # a copy: the shard takes the matrices it stacks
    gathered = {}
    for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        w = weights[f"blk.{layer}.{n}.weight"]
        ew = ExpertWeights(arch.n_experts, w.shape[2], w.shape[1])
        ew.weight = w
        gathered[n] = ew

    def gather(x: Tensor, sel: Tensor, gates: Tensor) -> Tensor:
        h = x.reshape(1, -1, 1, x.shape[-1])
        act = (gathered["ffn_gate_exps"](sel, h).silu() * gathered["ffn_up_exps"](sel, h)).contiguous()
        return (gathered["ffn_down_exps"](sel, act) * gates.unsqueeze(-1)).sum(axis=2).float().realize()

    print(f"arch {args.arch}: dim {arch.dim}, {arch.n_experts} experts of {arch.expert_ffn}, top {arch.top_k}")
    for rows in (int(r) for r in args.rows.split(",")):
        fused, gath = measure(shard, TinyJit(gather), layer, arch, rows, args.calls, args.rounds)
        print(f"rows {rows}: fused {fused:.3f} ms, gathered {gath:.3f} ms per call; gathered / fused {gath / fused:.1f}x")


def measure(shard, gather, layer: int, arch, rows: int, calls: int, rounds: int) -> tuple[float, float]:
    """Median ms per call of the shard and of the gathering jit, over interleaved rounds."""
    from tinygrad import Tensor

    from models.moe import ExpertCall

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, arch.dim)).astype(np.float32)
    sel = np.stack([rng.choice(arch.n_experts, arch.top_k, replace=False) for _ in range(rows)]).astype(np.int32)
    gates = np.full((rows, arch.top_k), 1.0 / arch.top_k, np.float32)
    call = ExpertCall(layer, x, sel, gates)

    def fused() -> np.ndarray:
        return shard.compute(call)

    def gathered() -> np.ndarray:
        return gather(Tensor(x).cast("float16"), Tensor(sel.reshape(1, rows, -1)),
                      Tensor(gates.reshape(1, rows, -1)).cast("float16")).numpy().reshape(rows, -1)

    for _ in range(3):  # capture both jits
        gathered()
        fused()
    assert np.allclose(gathered(), fused(), atol=5e-2), "the two ways disagree"
    times: dict[str, list[float]] = {"fused": [], "gathered": []}
    for _ in range(rounds):
        for name, fn in (("fused", fused), ("gathered", gathered)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times["fused"]), statistics.median(times["gathered"])

if __name__ == "__main__":
    main()
