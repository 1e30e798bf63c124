#!/usr/bin/env python3
"""One Kimi-K2-style MoE block holding 8 vs 384 routed experts, top-8: decode step time at batch 1 and 8.

The block is `kimi-k2-mini`'s (models/deepseek2.py, KIMI_K2_MINI: MLA attention, router, shared expert, routed
experts in Q4_0), its weights seeded (`models.catalog.seeded_quantized`), run as a `StageModel` of that one
block with its own expert shard, float arithmetic on the Q4_0 blocks, as `swarmd run` runs it. Two routings:

* `same 8`: a selection bias of +100 on experts 0-7 makes every row choose those 8 (gates unchanged), so
  both blocks do the same expert work and differ only in how many experts they hold;
* `routed`: the router's own choice; at batch 8 the 384-expert block's rows pick up to 64 distinct experts.

Beside it, "before": the expert shard of the code before (every expert held run on every row, as one fused
MLP whose neurons are scaled by each row's gate, float16 weights), on the same calls. Rounds are interleaved;
medians of rounds of per-round median steps.

    DEV=CPU python scripts/bench_kimi_moe.py                 # CPU figures of docs/BENCHMARKS.md
    python scripts/bench_kimi_moe.py --rounds 3 --steps 10   # quicker
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import replace

import numpy as np


def make_block(n_experts: int, same: bool, batch: int, device: str | None):
    from models.deepseek2 import KIMI_K2_MINI
    from models.stage import StageModel

    config = replace(KIMI_K2_MINI, n_experts=n_experts, n_blocks=3).config(vocab=49152, max_context=256)
    stage = StageModel.random(config, 0, 1, 2, max_context=256, max_requests=batch, device=device,
                              numerics="float")
    if same:
        from tinygrad import Tensor

        bias = np.zeros(n_experts, np.float32)
        bias[:8] = 100.0
        stage.blk[1].exp_probs_b["bias"].assign(Tensor(bias, device=stage.device)).realize()
    return stage


class EveryExpertShard:
    """The code before: every expert held runs on every row (fused gate/up of all experts, neurons scaled by
    the row's gate for their expert, 0 when not chosen), float16 weights."""

    def __init__(self, shard):
        from models.kernels.quant import BlockQuantized
        from models.tinygrad_ext.jit import HeldInputs

        self.weights, self._jits, self.inputs = {}, {}, HeldInputs(shard.device)
        for layer, (gate_up, down) in shard.weights.items():
            gu = gate_up.dequantized() if isinstance(gate_up, BlockQuantized) else gate_up
            dn = down.dequantized() if isinstance(down, BlockQuantized) else down
            n, f2, dim = gu.shape
            f = f2 // 2  # every expert's gate rows, then every expert's up rows
            self.weights[layer] = (gu[:, :f].reshape(n * f, dim).cat(gu[:, f:].reshape(n * f, dim))
                                   .cast("float16").contiguous().realize(),
                                   dn.permute(1, 0, 2).reshape(dim, -1).cast("float16").contiguous().realize())
            self.n, self.local = n, shard._local[layer]

    def __call__(self, call):
        from models.tinygrad_ext.jit import capturing_jit, read_back

        rows, dim = call.rows.shape
        padded = 1 << (rows - 1).bit_length()
        x = np.zeros((padded, dim), np.float32)
        x[:rows] = call.rows
        gates = np.zeros((padded, self.n), np.float32)
        r, c = np.nonzero(call.sel >= 0)
        np.add.at(gates, (r, self.local[call.sel[r, c]]), call.gates[r, c])
        key = (call.layer, padded)
        if key not in self._jits:
            self._jits[key] = capturing_jit(functools.partial(self._step, call.layer))
        return read_back(self._jits[key](self.inputs(x, slot=0), self.inputs(gates, slot=1)))[:rows]

    def _step(self, layer, x, gates):
        from models.kernels.matvec import matvec

        gate_up, down = self.weights[layer]
        rows, n = gates.shape
        g, u = matvec(x, gate_up).chunk(2, dim=-1)
        act = (g.silu() * u).reshape(rows, n, -1) * gates.reshape(rows, n, 1)
        return matvec(act.reshape(rows, -1), down).float().realize()


def measure(stage, batch: int, steps: int, before) -> dict[str, float]:
    """Median decode step of `batch` requests (block step with its own shard), and of the shard's calls alone,
    new and before."""
    from models.stage import StageInput

    rng = np.random.default_rng(batch)
    ids = [f"r{b}" for b in range(batch)]
    for rid in ids:
        stage.add_request(rid)
        stage.forward([StageInput(rid, 0, rng.standard_normal((8, stage.hidden_size)).astype(np.float32))])
    calls, block = [], []

    def recording(call):
        calls.append(call)
        return stage.expert_shard(call)

    for step in range(steps + 3):
        items = [StageInput(rid, 8 + step, rng.standard_normal((1, stage.hidden_size)).astype(np.float32))
                 for rid in ids]
        t = time.perf_counter()
        stage.forward(items, experts=recording)
        block.append(time.perf_counter() - t)
    for rid in ids:
        stage.free_request(rid)
    shard_new, shard_before = [], []
    for call in calls:
        t = time.perf_counter()
        stage.expert_shard(call)
        shard_new.append(time.perf_counter() - t)
        t = time.perf_counter()
        before(call)
        shard_before.append(time.perf_counter() - t)
    distinct = statistics.mean(len(set(c.sel[c.sel >= 0].tolist())) for c in calls)
    return {"block": statistics.median(block[3:]), "shard": statistics.median(shard_new[3:]),
            "before": statistics.median(shard_before[3:]), "distinct": distinct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", default="8,384")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    experts = [int(e) for e in args.experts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    cases = [(n, same, b) for same in (True, False) for b in batches for n in experts]
    t0 = time.time()
    blocks, befores = {}, {}
    for n, same, b in cases:  # build and warm every case first (compiles), then interleave the rounds
        blocks[(n, same, b)] = make_block(n, same, b, args.device)
        befores[(n, same, b)] = EveryExpertShard(blocks[(n, same, b)].expert_shard)
        measure(blocks[(n, same, b)], b, 3, befores[(n, same, b)])
    print(f"built and warmed in {time.time() - t0:.0f} s", flush=True)
    results: dict[tuple, list[dict[str, float]]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c in cases:
            results[c].append(measure(blocks[c], c[2], args.steps, befores[c]))
    print("| routing | batch | experts held | distinct experts per call | block step (ms) | x vs 8 held | "
          "expert shard (ms) | expert shard before (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for same in (True, False):
        for b in batches:
            base = statistics.median(r["block"] for r in results[(experts[0], same, b)])
            for n in experts:
                rs = results[(n, same, b)]
                med = {k: statistics.median(r[k] for r in rs) for k in ("block", "shard", "before", "distinct")}
                print(f"| {'same 8' if same else 'routed'} | {b} | {n} | {med['distinct']:.1f} | {med['block'] * 1e3:.2f} "
                      f"| {med['block'] / base:.2f} | {med['shard'] * 1e3:.2f} | {med['before'] * 1e3:.2f} |", flush=True)
    print(f"\n({args.rounds} rounds of {args.steps} steps, {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
