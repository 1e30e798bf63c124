"""Seeded random weights for synthetic models (tests, and benchmarks of shapes no file is at hand for).

Each tensor is drawn from its own generator keyed by (seed, GGUF name), so block i has the same
weights whichever stage holds it, and a routed expert the same weights whichever node holds it.
MoE configs (`models.moe.MoEConfig`) get their router, selection bias, routed and shared experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from models.moe import block_config, is_moe_block

if TYPE_CHECKING:
    from tinygrad import Tensor


def block_shapes(config, i: int, *, routed: bool = True) -> dict[str, tuple[int, ...]]:
    """GGUF name (without `blk.{i}.`) -> numpy shape of each tensor of block i."""
    c = block_config(config, i)
    shapes = {"attn_norm.weight": (c.dim,), "attn_q.weight": (c.n_heads * c.head_dim, c.dim),
              "attn_k.weight": (c.n_kv_heads * c.head_dim, c.dim),
              "attn_v.weight": (c.n_kv_heads * c.head_dim, c.dim),
              "attn_output.weight": (c.dim, c.n_heads * c.head_dim), "ffn_norm.weight": (c.dim,)}
    if not is_moe_block(config, i):
        return shapes | {"ffn_gate.weight": (c.hidden_dim, c.dim), "ffn_up.weight": (c.hidden_dim, c.dim),
                         "ffn_down.weight": (c.dim, c.hidden_dim)}
    shapes["ffn_gate_inp.weight"] = (c.num_experts, c.dim)
    if c.expert_bias:
        shapes["exp_probs_b.bias"] = (c.num_experts,)
    if routed:
        shapes |= {f"{n}.weight": s for n, s in expert_shapes(c, c.num_experts).items()}
    if c.shared_expert_dim:
        s = c.shared_expert_dim
        shapes |= {"ffn_gate_shexp.weight": (s, c.dim), "ffn_up_shexp.weight": (s, c.dim),
                   "ffn_down_shexp.weight": (c.dim, s)}
        if c.shared_expert_gate:
            shapes["ffn_gate_inp_shexp.weight"] = (c.dim,)
    return shapes


def expert_shapes(config, n: int) -> dict[str, tuple[int, int, int]]:
    c = config
    return {"ffn_gate_exps": (n, c.hidden_dim, c.dim), "ffn_up_exps": (n, c.hidden_dim, c.dim),
            "ffn_down_exps": (n, c.dim, c.hidden_dim)}


def random_weights(config, seed: int, start: int, end: int, dtype: str = "float16", *,
                   routed: bool = True) -> dict[str, Tensor]:
    """Seeded random weights for blocks [start, end) (and the embedding/head where the stage needs them),
    GGUF-named; `routed=False` leaves out the routed experts (a stage whose experts live elsewhere)."""
    from tinygrad import Tensor

    c = config
    out: dict[str, Tensor] = {}
    for i in range(start, end):
        for n, shape in block_shapes(c, i, routed=False).items():
            out[f"blk.{i}.{n}"] = Tensor(random_array(seed, f"blk.{i}.{n}", shape)).cast(dtype).realize()
    if start == 0:
        out["token_embd.weight"] = Tensor(random_array(seed, "token_embd.weight", (c.vocab_size, c.dim))).cast(dtype)
    if end == c.num_blocks:
        out["output_norm.weight"] = Tensor(random_array(seed, "output_norm.weight", (c.dim,))).cast(dtype)
        out["output.weight"] = Tensor(random_array(seed, "output.weight", (c.vocab_size, c.dim))).cast(dtype)
    if routed:
        every = {i: range(c.num_experts) for i in range(start, end) if is_moe_block(c, i)}
        out |= random_expert_weights(c, seed, every, dtype)
    return {k: v.realize() for k, v in out.items()}


def random_expert_weights(config, seed: int, experts: Mapping[int, Sequence[int]],
                          dtype: str = "float16") -> dict[str, Tensor]:
    """The routed experts `experts[layer]` of each layer, stacked in that order under their GGUF names;
    expert e of block i is drawn from its own generator, so any subset has the whole model's values."""
    from tinygrad import Tensor

    out = {}
    for i, es in experts.items():
        for n, (_, rows, cols) in expert_shapes(config, 1).items():
            stack = np.stack([random_array(seed, f"blk.{i}.{n}.weight#{e}", (rows, cols)) for e in es])
            out[f"blk.{i}.{n}.weight"] = Tensor(stack).cast(dtype).realize()
    return out


def random_array(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic float32 values for tensor `name`: norms near 1, matrices scaled by 1/sqrt(fan-in),
    a selection bias small."""
    import zlib

    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith(".bias"):
        return (0.01 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
