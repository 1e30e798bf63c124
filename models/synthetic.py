"""Seeded random weights for synthetic models (tests, and benchmarks of shapes no file is at hand for).

Each tensor is drawn from its own generator keyed by (seed, GGUF name), so block i has the same
weights whichever stage holds it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tinygrad import Tensor


def random_weights(config, seed: int, start: int, end: int, dtype: str = "float16") -> dict[str, Tensor]:
    """Seeded random weights for blocks [start, end) (and the embedding/head where the stage needs them),
    GGUF-named; each tensor is drawn from its own generator keyed by (seed, name)."""
    from tinygrad import Tensor

    c = config
    shapes = {"attn_norm.weight": (c.dim,), "attn_q.weight": (c.n_heads * c.head_dim, c.dim),
              "attn_k.weight": (c.n_kv_heads * c.head_dim, c.dim),
              "attn_v.weight": (c.n_kv_heads * c.head_dim, c.dim),
              "attn_output.weight": (c.dim, c.n_heads * c.head_dim), "ffn_norm.weight": (c.dim,),
              "ffn_gate.weight": (c.hidden_dim, c.dim), "ffn_up.weight": (c.hidden_dim, c.dim),
              "ffn_down.weight": (c.dim, c.hidden_dim)}
    named = {f"blk.{i}.{n}": s for i in range(start, end) for n, s in shapes.items()}
    if start == 0:
        named["token_embd.weight"] = (c.vocab_size, c.dim)
    if end == c.num_blocks:
        named.update({"output_norm.weight": (c.dim,), "output.weight": (c.vocab_size, c.dim)})
    return {name: Tensor(random_array(seed, name, shape)).cast(dtype).realize() for name, shape in named.items()}


def random_array(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic float32 values for tensor `name`: norms near 1, matrices scaled by 1/sqrt(fan-in)."""
    import zlib

    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
