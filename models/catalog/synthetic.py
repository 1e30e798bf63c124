"""Seeded random weights for synthetic models (tests, and benchmarks of shapes no file is at hand for).

Each tensor is drawn from its own generator keyed by (seed, GGUF name), so block i has the same
weights whichever stage holds it, and a routed expert the same weights whichever node holds it.
MoE configs (`models.moe.MoEConfig`) get their router, selection bias, routed and shared experts.
Tensors are drawn on a thread pool (numpy's generators release the GIL), so an 8B-parameter model
takes seconds, not minutes, on a many-core host.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from models.gguf.loader import StageParts
from models.moe import block_config, is_moe_block

if TYPE_CHECKING:
    from tinygrad import Tensor

NUMPY_DTYPES = {"float16": np.float16, "float32": np.float32}


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


def weight_shapes(config, start: int, end: int, held: StageParts | None = None) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape of every tensor blocks [start, end) hold but their routed experts (and the
    embedding/head at the ends), but those of the parts in `held`."""
    c, held = config, held or StageParts()
    named = {f"blk.{i}.{n}": s for i in range(start, end) if i not in held.blocks
             for n, s in block_shapes(c, i, routed=False).items()}
    if start == 0 and not held.embedding:
        named["token_embd.weight"] = (c.vocab_size, c.dim)
    if end == c.num_blocks and not held.head:
        named.update({"output_norm.weight": (c.dim,), "output.weight": (c.vocab_size, c.dim)})
    return named


def random_weights(config, seed: int, start: int, end: int, dtype: str = "float16", device: str | None = None, *,
                   routed: bool = True, held: StageParts | None = None) -> dict[str, Tensor]:
    """Seeded random weights for blocks [start, end) (and the embedding/head where the stage needs them),
    GGUF-named, realised on `device`; `routed=False` leaves out the routed experts (a stage whose experts
    live elsewhere); the parts in `held` are left out (a stage already holds them)."""
    from tinygrad import Tensor

    items = list(weight_shapes(config, start, end, held).items())
    to = NUMPY_DTYPES.get(dtype, np.float32)

    def draw(item: tuple[str, tuple[int, ...]]) -> np.ndarray:
        return random_array(seed, *item).astype(to, copy=False)

    out: dict[str, Tensor] = {}
    workers = min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for lo in range(0, len(items), 2 * workers):  # a bounded number of host arrays alive at once
            batch = items[lo:lo + 2 * workers]
            for (name, _), arr in zip(batch, pool.map(draw, batch), strict=True):
                t = Tensor(arr, device=device)
                out[name] = (t if dtype in NUMPY_DTYPES else t.cast(dtype)).realize()
    if routed:
        every = {i: range(config.num_experts) for i in range(start, end)
                 if is_moe_block(config, i) and not (held and i in held.blocks)}
        out |= random_expert_weights(config, seed, every, dtype, device)
    return out


def random_expert_weights(config, seed: int, experts: Mapping[int, Sequence[int]],
                          dtype: str = "float16", device: str | None = None) -> dict[str, Tensor]:
    """The routed experts `experts[layer]` of each layer, stacked in that order under their GGUF names;
    expert e of block i is drawn from its own generator, so any subset has the whole model's values."""
    from tinygrad import Tensor

    out = {}
    for i, es in experts.items():
        for n, (_, rows, cols) in expert_shapes(config, 1).items():
            stack = np.stack([random_array(seed, f"blk.{i}.{n}.weight#{e}", (rows, cols)) for e in es])
            out[f"blk.{i}.{n}.weight"] = Tensor(stack, device=device).cast(dtype).realize()
    return out


def random_array(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic float32 values for tensor `name`: norms near 1, biases near 0, matrices scaled by
    1/sqrt(fan-in)."""
    import zlib

    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith(".bias"):
        values *= np.float32(0.01)
    elif len(shape) == 1:
        values *= np.float32(0.1)
        values += np.float32(1.0)
    else:
        values *= np.float32(1 / math.sqrt(shape[-1]))
    return values
