"""The routed experts of some MoE layers that one node holds apart from a stage.

`ExpertShard` does, for a batch of rows, the work of the experts those rows selected, not of every expert held:
the selected (row, expert) pairs are laid out on the host as slots of one expert each (`dispatch`), and one
jitted graph per layout (the layer's matrices are its inputs: every layer shares it) gathers the slots' expert
matrices by index inside its kernels (`models.kernels.gathered.gathered_matvec`), so only the chosen experts' bytes are read and GGML-block experts stay
quantised. A node answers one output per selection; `models.moe.gated_sum` makes each row's sum in the order of
its selections, wherever the experts live. A stage holding its experts can run them inside its own graph
(`ExpertShard.in_graph`). Held 8 vs 384 experts: docs/BENCHMARKS.md, "Kimi-class MoE".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tinygrad.llm.model import TransformerConfig

from models import cached_graphs
from models.errors import ModelError
from models.kernels.block_gemv import (
    block_gemv,
    block_gemv_fits,
    block_gemv_fits_shape,
    extra_fits,
    glu_in_kernel_on,
    shared_in_experts_on,
)
from models.kernels.gated_sum import gated_sum_fits, residual_plus_gated
from models.kernels.gathered import gated_matvec, gathered_matvec, pairs_per_kernel, shared_rows
from models.kernels.matvec import tune_cpu_renderer
from models.moe import EXPERT_TENSORS, ExpertCall, gated_sum, is_moe_block
from models.tinygrad_ext.jit import HeldInputs, read_back

if TYPE_CHECKING:
    from tinygrad import Tensor

    from models.cached_graphs import StoringJit
    from models.kernels.quant import BlockQuantized




class ExpertShard:
    """Routed experts of some MoE layers, as one node holds them: `experts` maps a layer to the global
    indices of its experts held here; weights are keyed by GGUF name, each `blk.{i}.ffn_*_exps.weight`
    holding just those experts in that order (float tensors, or GGML blocks that stay quantised).

    A call does the work of the experts its rows selected, not of every expert held: the selected (row,
    expert) pairs are laid out on the host as slots of one expert each (`dispatch`), and one jitted graph per
    layout, shared by the layers, gathers the slots' expert matrices by index inside its kernels (only the chosen
    experts' bytes are read). Each pair's output is the same whichever node computes it and whatever else is
    in its call (the kernels' reductions are pinned), and a row's outputs are summed in the order of its
    selections (`gated_sum`), so the sum does not depend on where the experts live."""

    def __init__(self, config: TransformerConfig, weights: dict[str, Tensor | BlockQuantized],
                 experts: Mapping[int, Sequence[int]], device: str | None = None, numerics: str = "float",
                 source: str = ""):
        """`source` names the weights (as `StageModel.source`), so that their graphs can be cached. `weights` is
        handed over: each layer's matrices are taken out of it as they are stacked, so that every layer's are not
        held twice at once (a Kimi-class layer's gate and up are 6.3 GB)."""
        from tinygrad import Device

        self.device = Device.canonicalize(device)
        tune_cpu_renderer(self.device)
        self.config, self.numerics = config, numerics
        self.experts = {int(layer): tuple(int(e) for e in es) for layer, es in experts.items()}
        self.weights: dict[int, tuple[Tensor | BlockQuantized, Tensor | BlockQuantized]] = {}  # (gate+up, down)
        self._local: dict[int, np.ndarray] = {}  # layer -> global expert index -> local index (-1: not here)
        for layer, es in self.experts.items():
            if not is_moe_block(config, layer):
                raise ModelError(f"block {layer} is not a MoE block of this model")
            if any(not 0 <= e < config.num_experts for e in es) or len(set(es)) != len(es):
                raise ModelError(f"block {layer}: bad expert indices {es} for {config.num_experts} experts")
            gate, up, down = (weights.pop(f"blk.{layer}.{n}.weight") for n in EXPERT_TENSORS)
            self.weights[layer] = (_stack_gate_up(gate, up, self.device), _on_device(down, self.device))
            local = np.full(config.num_experts, -1, np.int32)
            local[list(es)] = np.arange(len(es), dtype=np.int32)
            self._local[layer] = local
        self._jits: dict[tuple, StoringJit] = {}  # (slots, rows per slot, the weights' shapes) -> graph
        self._inputs = HeldInputs(self.device)
        self.source = source
        self.graphs = cached_graphs.for_experts(self)

    @classmethod
    def random(cls, config: TransformerConfig, seed: int, experts: Mapping[int, Sequence[int]], *,
               dtype: str = "float16", device: str | None = None) -> ExpertShard:
        """The experts of a seeded synthetic model (`models.catalog.synthetic`), the same weights a whole
        `StageModel.random` of that seed holds."""
        from models.catalog.synthetic import random_expert_weights

        return cls(config, random_expert_weights(config, seed, experts, dtype), experts, device,
                   source=f"seed {seed} {dtype}")

    @classmethod
    def from_gguf(cls, path, experts: Mapping[int, Sequence[int]], *, dtype: str | None = None,
                  device: str | None = None, numerics: str = "float") -> ExpertShard:
        """Experts of a MoE GGUF, reading only the bytes of the experts held; `dtype` "quantized" keeps
        Q4_0/Q4_1/Q8_0 experts in their GGML blocks (required by ggml numerics; the default for them and for
        `deepseek2` models)."""
        from models.config import config_from_header
        from models.deepseek2 import is_mla
        from models.gguf.header import read_header
        from models.gguf.loader import load_expert_weights

        header = read_header(path)
        config = config_from_header(header)
        if numerics == "ggml" or dtype is None:
            dtype = "quantized" if numerics == "ggml" or is_mla(config) else "float16"
        return cls(config, load_expert_weights(header, experts, device=device, dtype=dtype), experts, device,
                   numerics, source=f"gguf {Path(path).resolve()} {dtype}")

    def holds(self, layer: int) -> tuple[int, ...]:
        return self.experts.get(layer, ())

    def weight_bytes(self) -> int:
        return sum(w.nbytes() for ws in self.weights.values() for w in ws)

    def warmup(self, max_rows: int = 1) -> None:
        """Compile and capture each layer's graph for the layouts of decode batches up to `max_rows` rows
        whose experts are all distinct, and all shared."""
        k = self.config.num_experts_per_tok
        for layer, es in self.experts.items():
            for rows in sorted({1 << (n - 1).bit_length() for n in range(1, max_rows + 1)}):
                for spread in (True, False):
                    picks = [[es[(r * k + j) % len(es) if spread else j % len(es)] for j in range(min(k, len(es)))]
                             for r in range(rows)]
                    sel = np.array(picks, np.int32)
                    call = ExpertCall(layer, np.zeros((rows, self.config.dim), np.float32), sel,
                                      np.zeros(sel.shape, np.float32))
                    for _ in range(2):  # tinygrad's jit runs a graph once, then captures it
                        self.expert_outputs(call)

    def __call__(self, call: ExpertCall) -> np.ndarray:
        return self.compute(call)

    def compute(self, call: ExpertCall) -> np.ndarray:
        """Per row of `call`, the gate-weighted sum of its selected experts (all of which must be held)."""
        return gated_sum(call, self.expert_outputs(call))

    def expert_outputs(self, call: ExpertCall) -> np.ndarray:
        """(pairs, dim) float32: each selected expert's output for its row, pairs in row-major order of
        `call.sel >= 0` (what a node sends back; `gated_sum` makes the rows' sums)."""
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
            return np.zeros((0, dim), np.float32)
        slots, place = dispatch(local)
        n_slots, per_slot = _bucket(len(slots)), _bucket(int(place[:, 1].max()) + 1)
        x = np.zeros((n_slots, per_slot, dim), np.float32)
        x[place[:, 0], place[:, 1]] = call.rows[row]
        idx = np.full(n_slots, slots[0], np.int32)
        idx[:len(slots)] = slots
        gate_up, down = self.weights[call.layer]
        weights = (*_tensors(gate_up), *_tensors(down))
        key = (n_slots, per_slot, tuple((t.shape, t.dtype.name) for t in weights))
        if key not in self._jits:  # one graph for every layer whose experts have these shapes
            self._jits[key] = self.graphs.jit(("experts", *key), functools.partial(self._step, gate_up, down))
        res = self._jits[key].replay(call.layer, (self._inputs(x, slot=0), self._inputs(idx, slot=1), *weights))
        return read_back(res)[place[:, 0], place[:, 1]]

    def in_graph(self, layer: int, x: Tensor, gates: Tensor, sel: Tensor, residual: Tensor,
                 shared: Tensor | None = None, shared_ffn: tuple[BlockQuantized, BlockQuantized] | None = None) -> Tensor:
        """The routed experts inside a stage's graph (no host round trip): x (B, T, dim) normed rows, gates and
        sel (B, T, k) as `route` gives them (every expert held here, local index = global index); each
        (row, selection) pair gathers its expert's matrices by index. -> `residual` (B, T, dim), plus `shared`
        (the shared experts' output) if given, plus the rows' gated sums: the bits of `compute`'s sums added to
        it, as a graph cut after the router adds them. `shared_ffn`: instead of `shared`, the shared expert's
        GGML blocks as `shared_expert` takes them: at a step of one row, one more slot of the routed experts'
        products, with `shared_expert`'s bits."""
        gate_up, down = self.weights[layer]
        b, t, dim = x.shape
        k = sel.shape[-1]
        ggml = self.numerics == "ggml"
        rows = x.reshape(b * t, 1, dim)  # each read by its k (row, expert) pairs
        idx = sel.reshape(-1).cast("int32")
        if shared_ffn is not None:
            if b * t == 1 and self._takes_shared(rows, gate_up, down, shared_ffn, k):
                act = block_gemv(rows, gate_up, idx, share=k, glu=True, extra=shared_ffn[0])
                out = block_gemv(act, down, idx, extra=shared_ffn[1], extra_x=k)  # k routed slots, then the shared
                return residual_plus_gated(residual, out, gates, shared_after=True)
            shared = shared_expert(x, *shared_ffn)

        def experts(rows: Tensor, idx: Tensor, share: int) -> Tensor:
            act = gated_matvec(rows, gate_up, idx, ggml=ggml, share=share).contiguous()
            return gathered_matvec(act, down, idx, ggml=ggml).float()

        n, per = b * t * k, pairs_per_kernel(x.device)
        if per and isinstance(n, int) and n > per and n % per == 0:  # kernels of `per` pairs, one after another
            pairs = shared_rows(rows, k)
            parts = [experts(pairs[s:s + per], idx[s:s + per], 1) for s in range(0, n, per)]
            out = parts[0].cat(*parts[1:])
        else:
            out = experts(rows, idx, k)
        out = out.reshape(b, t, k, dim)
        if gated_sum_fits(out):
            return residual_plus_gated(residual, out, gates, shared)
        if shared is not None:
            residual = residual + shared
        return residual + gated_rows(out, gates)

    def _takes_shared(self, rows: Tensor, gate_up: Tensor | BlockQuantized, down: Tensor | BlockQuantized,
                      shared_ffn: tuple[BlockQuantized, BlockQuantized], k: int) -> bool:
        """Whether the routed experts' products of `rows` (1, 1, dim) take the shared expert as one more slot: both
        `block_gemv`'s with the gated product inside, its matrices laid out as the stacks' (kind and shape)."""
        from models.kernels.quant import BlockQuantized

        if self.numerics == "ggml" or not (isinstance(gate_up, BlockQuantized) and isinstance(down, BlockQuantized)):
            return False
        return (glu_in_kernel_on() and gated_sum_fits(rows) and block_gemv_fits(rows, gate_up, gathered=True)
                and block_gemv_fits_shape(rows.device, (k + 1, 1, down.shape[2]), down, gathered=True)
                and extra_fits(gate_up, shared_ffn[0]) and extra_fits(down, shared_ffn[1]))

    def _step(self, like_gate_up: Tensor | BlockQuantized, like_down: Tensor | BlockQuantized, x: Tensor, idx: Tensor,
              *weights: Tensor) -> Tensor:
        """Each slot's expert (gathered by index) on the slot's rows: x (slots, rows, dim) -> same shape. The
        layer's matrices come in as the jit's inputs (`weights`, the tensors of a gate+up and a down stack laid
        out as `like_gate_up` and `like_down`), so that one captured graph serves every layer."""
        n = len(_tensors(like_gate_up))
        gate_up, down = _rebuilt(like_gate_up, weights[:n]), _rebuilt(like_down, weights[n:])
        ggml = self.numerics == "ggml"
        act = gated_matvec(x, gate_up, idx, ggml=ggml).contiguous()
        return gathered_matvec(act, down, idx, ggml=ggml).float().realize()


def shared_expert_fits(x: Tensor, gate_up: BlockQuantized, down: BlockQuantized) -> bool:
    """Whether `shared_expert` runs for x (..., dim) and a shared expert's GGML blocks ([gate | up], down)."""
    if not (shared_in_experts_on() and glu_in_kernel_on() and all(isinstance(n, int) for n in x.shape)):
        return False
    rows = math.prod(x.shape[:-1])
    return (block_gemv_fits_shape(x.device, (1, rows, x.shape[-1]), gate_up, gathered=False, stacked=True)
            and block_gemv_fits_shape(x.device, (1, rows, down.cols), down, gathered=False, stacked=True))


def shared_expert(x: Tensor, gate_up: BlockQuantized, down: BlockQuantized) -> Tensor:
    """A MoE block's shared expert on x (..., dim) -> (..., dim): `block_gemv`'s products laid out as a routed
    expert's (`stacked`), so that its outputs have the bits it has as one more slot of the routed experts'
    products (`ExpertShard.in_graph`); `shared_expert_fits` says where it runs."""
    *lead, dim = x.shape
    act = block_gemv(x.reshape(1, -1, dim), gate_up, glu=True, stacked=True)
    return block_gemv(act, down, stacked=True).reshape(*lead, -1)


def gated_rows(outputs: Tensor, gates: Tensor) -> Tensor:
    """Per row, gate times output of each selection (outputs (..., k, dim), gates (..., k)), added in the order of
    the row's selections, each product and sum rounded as `models.moe.gated_sum` rounds them on a swarm's host:
    the products are written out (fused, a multiply-add rounds once), then added one after another, and the sum
    written out (fused with what follows, tinygrad's kernel rounds otherwise)."""
    products = (outputs * gates.contiguous().unsqueeze(-1)).contiguous()
    total = products[..., 0, :]
    for j in range(1, outputs.shape[-2]):
        total = total + products[..., j, :]
    return total.contiguous()


def dispatch(local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How a call's selected pairs (their local expert indices, row-major) are laid out: (the expert of each
    slot, each pair's (slot, row in slot)). Pairs of one expert share a slot (its matrices are read once for
    all its rows) when that does not pad the work past one slot per pair; otherwise every pair has a slot."""
    experts, counts = np.unique(local, return_counts=True)
    pairs = len(local)
    if _bucket(len(experts)) * _bucket(int(counts.max())) <= _bucket(pairs):
        slot_of = np.searchsorted(experts, local)
        order = np.argsort(slot_of, kind="stable")
        within = np.empty(pairs, np.int64)
        within[order] = np.arange(pairs) - np.repeat(np.cumsum(counts) - counts, counts)
        return experts.astype(np.int32), np.stack([slot_of, within], axis=1)
    return local.astype(np.int32), np.stack([np.arange(pairs), np.zeros(pairs, np.int64)], axis=1)


def _tensors(w: Tensor | BlockQuantized) -> tuple[Tensor, ...]:
    """The tensors a matrix stack is made of: itself, or a GGML block stack's codes, scales (and offsets)."""
    from models.kernels.quant import BlockQuantized

    return tuple(w.buffers()) if isinstance(w, BlockQuantized) else (w,)


def _rebuilt(like: Tensor | BlockQuantized, tensors: Sequence[Tensor]) -> Tensor | BlockQuantized:
    """A stack laid out as `like`, made of `tensors` (as `_tensors` lists them)."""
    from models.kernels.quant import BlockQuantized

    if not isinstance(like, BlockQuantized):
        return tensors[0]
    return dataclasses.replace(like, q=tensors[0], d=tensors[1], m=tensors[2] if like.m is not None else None)


def _bucket(n: int) -> int:
    """n padded to a power of two: few shapes to compile."""
    return 1 << (max(n, 1) - 1).bit_length()


def _on_device(w: Tensor | BlockQuantized, device: str) -> Tensor | BlockQuantized:
    from models.kernels.quant import BlockQuantized

    if isinstance(w, BlockQuantized):
        return w
    return w.to(device).contiguous().realize()


def _stack_gate_up(gate: Tensor | BlockQuantized, up: Tensor | BlockQuantized,
                   device: str) -> Tensor | BlockQuantized:
    """Each expert's gate and up matrices as one (n, 2 * ffn, dim) stack: one product reads both."""
    from models.kernels.quant import BlockQuantized

    if isinstance(gate, BlockQuantized) and isinstance(up, BlockQuantized) and gate.kind == up.kind:
        n, ffn, dim = gate.shape or (1, gate.rows, gate.cols)

        def stack(a: Tensor, b: Tensor) -> Tensor:
            return a.reshape(n, ffn, -1).cat(b.reshape(n, ffn, -1), dim=1).reshape(n * 2 * ffn, -1)

        m = None if gate.m is None or up.m is None else stack(gate.m, up.m)
        return BlockQuantized(stack(gate.q, up.q), stack(gate.d, up.d), m, dim, gate.q8_1, (n, 2 * ffn, dim),
                              gate.code_offset).realize()
    dense = [w.dequantized() if isinstance(w, BlockQuantized) else w for w in (gate, up)]
    return dense[0].to(device).cat(dense[1].to(device), dim=1).contiguous().realize()
