"""The routed experts of some MoE layers that one node holds apart from a stage.

`ExpertShard` computes, for a batch of rows, the gate-weighted sum of its experts: every expert held runs on
every row as one fused MLP whose intermediate neurons are scaled by the row's gate for their expert (0: not
selected), through `models.kernels.matvec` (jitted per layer and padded row count). On a CPU that is faster
than gathering each row's expert matrices (tinygrad.llm's `ExpertWeights`): docs/BENCHMARKS.md, "Figures moved
out of the code" (`scripts/bench_expert_shard.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from tinygrad.llm.model import TransformerConfig

from models.errors import ModelError
from models.kernels.matvec import matvec, tune_cpu_renderer
from models.moe import ExpertCall, is_moe_block
from models.tinygrad_ext.jit import HeldInputs, capturing_jit, read_back

if TYPE_CHECKING:
    from tinygrad import Tensor, TinyJit

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class ExpertShard:
    """Routed experts of some MoE layers, as one node holds them: `experts` maps a layer to the global
    indices of its experts held here; weights are keyed by GGUF name, each `blk.{i}.ffn_*_exps.weight`
    holding just those experts in that order."""

    def __init__(self, config: TransformerConfig, weights: Mapping[str, Tensor],
                 experts: Mapping[int, Sequence[int]], device: str | None = None):
        from tinygrad import Device

        self.device = Device.canonicalize(device)
        tune_cpu_renderer(self.device)
        self.config = config
        self.experts = {int(layer): tuple(int(e) for e in es) for layer, es in experts.items()}
        self.weights: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> (gate and up stacked, down side by side)
        self._local: dict[int, np.ndarray] = {}  # layer -> global expert index -> local index (-1: not here)
        for layer, es in self.experts.items():
            if not is_moe_block(config, layer):
                raise ModelError(f"block {layer} is not a MoE block of this model")
            if any(not 0 <= e < config.num_experts for e in es) or len(set(es)) != len(es):
                raise ModelError(f"block {layer}: bad expert indices {es} for {config.num_experts} experts")
            gate, up, down = (weights[f"blk.{layer}.{n}.weight"].to(self.device) for n in EXPERT_TENSORS)
            n, ffn, dim = gate.shape
            self.weights[layer] = (gate.reshape(n * ffn, dim).cat(up.reshape(n * ffn, dim)).contiguous().realize(),
                                   # one expert: a reshape of its buffer (a no-op permute would leave a
                                   # wrapper around it, which models.kernels.matvec takes for a dequantising graph)
                                   down.reshape(dim, ffn).contiguous().realize() if n == 1 else
                                   down.permute(1, 0, 2).reshape(dim, n * ffn).contiguous().realize())
            local = np.full(config.num_experts, -1, np.int32)
            local[list(es)] = np.arange(len(es), dtype=np.int32)
            self._local[layer] = local
        self._jits: dict[tuple[int, int], TinyJit] = {}
        self._inputs = HeldInputs(self.device)

    @classmethod
    def random(cls, config: TransformerConfig, seed: int, experts: Mapping[int, Sequence[int]], *,
               dtype: str = "float16", device: str | None = None) -> ExpertShard:
        """The experts of a seeded synthetic model (`models.catalog.synthetic`), the same weights a whole
        `StageModel.random` of that seed holds."""
        from models.catalog.synthetic import random_expert_weights

        return cls(config, random_expert_weights(config, seed, experts, dtype), experts, device)

    @classmethod
    def from_gguf(cls, path, experts: Mapping[int, Sequence[int]], *, dtype: str = "float16",
                  device: str | None = None) -> ExpertShard:
        """Experts of a MoE GGUF, reading only the bytes of the experts held."""
        from models.config import config_from_header
        from models.gguf.header import read_header
        from models.gguf.loader import load_expert_weights

        header = read_header(path)
        config = config_from_header(header)
        return cls(config, load_expert_weights(header, experts, device=device, dtype=dtype), experts, device)

    def holds(self, layer: int) -> tuple[int, ...]:
        return self.experts.get(layer, ())

    def weight_bytes(self) -> int:
        return sum(w.nbytes() for ws in self.weights.values() for w in ws)

    def warmup(self, max_rows: int = 1) -> None:
        """Compile and capture each layer's graph for up to `max_rows` rows (padded to powers of two)."""
        for layer, es in self.experts.items():
            for rows in sorted({1 << (n - 1).bit_length() for n in range(1, max_rows + 1)}):
                call = ExpertCall(layer, np.zeros((rows, self.config.dim), np.float32),
                                  np.full((rows, 1), es[0], np.int32), np.zeros((rows, 1), np.float32))
                for _ in range(2):  # tinygrad's jit runs a graph once, then captures it
                    self.compute(call)

    def __call__(self, call: ExpertCall) -> np.ndarray:
        return self.compute(call)

    def compute(self, call: ExpertCall) -> np.ndarray:
        """Per row of `call`, the gate-weighted sum of its selected experts (all of which must be held)."""
        if call.layer not in self.weights:
            raise ModelError(f"this node holds no experts of block {call.layer}")
        n, dim = call.rows.shape
        if dim != self.config.dim or call.sel.shape != call.gates.shape or call.sel.shape[0] != n:
            raise ModelError(f"expert call for block {call.layer}: rows {call.rows.shape}, sel {call.sel.shape}, "
                             f"gates {call.gates.shape} do not fit dim {self.config.dim}")
        row, col = np.nonzero(call.sel >= 0)
        glob = call.sel[row, col]
        if glob.size and glob.max() >= self.config.num_experts:
            raise ModelError(f"expert call for block {call.layer}: expert index {int(glob.max())} out of range")
        local = self._local[call.layer][glob]
        if (local < 0).any():
            missing = sorted(set(glob[local < 0].tolist()))
            raise ModelError(f"block {call.layer}: experts {missing} are not held here")
        if not row.size:
            return np.zeros((n, dim), np.float32)
        padded = 1 << (n - 1).bit_length()  # rows padded to a power of two: few shapes to compile
        x = np.zeros((padded, dim), np.float32)
        x[:n] = call.rows
        gates = np.zeros((padded, len(self.experts[call.layer])), np.float32)  # each row's gate per expert held
        np.add.at(gates, (row, local), call.gates[row, col])
        if (call.layer, padded) not in self._jits:
            self._jits[(call.layer, padded)] = capturing_jit(functools.partial(self._step, call.layer))
        # two inputs, not one sliced in two: a jit replays stale data through a view of an input buffer
        res = self._jits[(call.layer, padded)](self._inputs(x, slot=0), self._inputs(gates, slot=1))
        return read_back(res)[:n].copy()

    def _step(self, layer: int, x: Tensor, gates: Tensor) -> Tensor:
        """Every expert held on every row, each expert's neurons scaled by the row's gate for it."""
        gate_up, down = self.weights[layer]
        rows, n = gates.shape
        g, u = matvec(x, gate_up).chunk(2, dim=-1)
        act = (g.silu() * u).reshape(rows, n, -1) * gates.reshape(rows, n, 1)
        return matvec(act.reshape(rows, -1), down).float().realize()
