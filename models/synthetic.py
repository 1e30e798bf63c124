"""Seeded random weights for synthetic models (tests, and benchmarks of shapes no file is at hand for).

Each tensor is drawn from its own generator keyed by (seed, GGUF name), so block i has the same
weights whichever stage holds it. Tensors are drawn on a thread pool (numpy's generators release the
GIL), so an 8B-parameter model takes seconds, not minutes, on a many-core host.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tinygrad import Tensor

NUMPY_DTYPES = {"float16": np.float16, "float32": np.float32}


def weight_shapes(config, start: int, end: int) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape of every tensor blocks [start, end) hold (and the embedding/head at the ends)."""
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
    return named


def random_weights(config, seed: int, start: int, end: int, dtype: str = "float16",
                   device: str | None = None) -> dict[str, Tensor]:
    """Seeded random weights for blocks [start, end) (and the embedding/head where the stage needs them),
    GGUF-named, realised on `device`; each tensor is drawn from its own generator keyed by (seed, name)."""
    from tinygrad import Tensor

    named = weight_shapes(config, start, end)
    to = NUMPY_DTYPES.get(dtype, np.float32)

    def draw(item: tuple[str, tuple[int, ...]]) -> np.ndarray:
        return random_array(seed, *item).astype(to, copy=False)

    out: dict[str, Tensor] = {}
    items = list(named.items())
    workers = min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for lo in range(0, len(items), 2 * workers):  # a bounded number of host arrays alive at once
            batch = items[lo:lo + 2 * workers]
            for (name, _), arr in zip(batch, pool.map(draw, batch), strict=True):
                t = Tensor(arr, device=device)
                out[name] = (t if dtype in NUMPY_DTYPES else t.cast(dtype)).realize()
    return out


def random_array(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic float32 values for tensor `name`: norms near 1, matrices scaled by 1/sqrt(fan-in)."""
    import zlib

    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(shape, dtype=np.float32)
    if len(shape) == 1:
        values *= np.float32(0.1)
        values += np.float32(1.0)
    else:
        values *= np.float32(1 / math.sqrt(shape[-1]))
    return values
