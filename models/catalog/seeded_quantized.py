"""Seeded Q4_0 weights drawn on the device, for full-width models no file is at hand for (`random/kimi-k2:N`).

A model of Kimi-K2's width holds 9.5 GB of routed experts per block at int4: drawing them on the host and
copying them over would take minutes per block. Here every value is a hash of (seed, tensor name, row,
column) computed in the device's own kernels, so any daemon draws the same weights for the blocks (and the
experts) it holds, whichever subset that is. Matrices are GGML Q4_0 blocks (`BlockQuantized`: 4-bit codes,
a float16 scale per 32: w = (q - 8) d), with values of standard deviation about
1/sqrt(fan-in); norms are near 1, the router and the selection bias are float32, as a Q4_0 file holds them.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from models.gguf.loader import StageParts
from models.kernels.quant import BlockQuantized

if TYPE_CHECKING:
    from tinygrad import Tensor

Q4_STD = math.sqrt((16 * 16 - 1) / 12)  # standard deviation of a uniform 4-bit code


def _key(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def _hash(rows: Tensor, cols: int, key: int) -> Tensor:
    """(len(rows), cols) uint32 hash values of (key, row, column); `rows` holds uint32 row numbers."""
    from tinygrad import Tensor, dtypes

    h = rows.reshape(-1, 1) * 0x9E3779B1 + Tensor.arange(cols, device=rows.device, dtype=dtypes.uint32).reshape(1, -1) \
        * 0x85EBCA77 + key
    h = h ^ (h >> 15)
    h = h * 0x2C1B3C6D
    h = h ^ (h >> 12)
    h = h * 0x297A2D39
    return h ^ (h >> 15)


def _uniform(rows: Tensor, cols: int, key: int) -> Tensor:
    """(len(rows), cols) float32 in [0, 1)."""
    from tinygrad import dtypes

    return (_hash(rows, cols, key) >> 8).cast(dtypes.float32) * (1.0 / (1 << 24))


def _row_numbers(n_rows: int, device: str | None, groups: Sequence[int] | None = None, per_group: int = 0) -> Tensor:
    """Row numbers 0..n_rows-1, or the rows of the given groups (experts) of `per_group` rows each."""
    from tinygrad import Tensor, dtypes

    if groups is None:
        return Tensor.arange(n_rows, device=device, dtype=dtypes.uint32)
    base = Tensor(list(groups), device=device, dtype=dtypes.uint32).reshape(-1, 1) * per_group
    return (base + Tensor.arange(per_group, device=device, dtype=dtypes.uint32).reshape(1, -1)).reshape(-1)


def q4_0_matrix(seed: int, name: str, shape: tuple[int, ...], device: str | None,
                groups: Sequence[int] | None = None) -> BlockQuantized:
    """A (..., out, in) Q4_0 matrix or stack; with `groups`, only those entries of the stack's first axis."""
    from tinygrad import dtypes

    cols = shape[-1]
    per_group = math.prod(shape[1:-1]) if len(shape) > 2 else shape[0]
    n = len(groups) if groups is not None else (shape[0] if len(shape) > 2 else 1)
    rows = _row_numbers(n * per_group if groups is not None else math.prod(shape[:-1]), device, groups,
                        per_group if groups is not None else 0)
    key = _key(seed, name)
    q = (_hash(rows, cols // 2, key) & 0xFF).cast(dtypes.uint8).contiguous().realize()
    scale = 1.0 / (Q4_STD * math.sqrt(cols))
    d = ((_uniform(rows, cols // 32, key ^ 0x5BD1E995) * 0.5 + 0.75) * scale).cast(dtypes.float16).contiguous().realize()
    out_shape = (n, *shape[1:]) if len(shape) > 2 else None
    return BlockQuantized(q, d, None, cols, False, out_shape, code_offset=8)  # Q4_0: w = (q - 8) d


def float_tensor(seed: int, name: str, shape: tuple[int, ...], device: str | None) -> Tensor:
    """float32 values: norms near 1, biases near 0, matrices (the router) of standard deviation 1/sqrt(fan-in)."""
    rows = _row_numbers(math.prod(shape[:-1]) if len(shape) > 1 else 1, device)
    u = _uniform(rows, shape[-1], _key(seed, name)).reshape(shape) * 2 - 1  # [-1, 1): deviation 1/sqrt(3)
    if name.endswith(".bias"):
        return (u * 0.01).contiguous().realize()
    if len(shape) == 1:
        return (u * 0.1 + 1.0).contiguous().realize()
    return (u * math.sqrt(3 / shape[-1])).contiguous().realize()


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """What a Q4_0 file quantises: matrices whose rows split into blocks of 32, but the router."""
    return len(shape) >= 2 and shape[-1] % 32 == 0 and "ffn_gate_inp" not in name


def stage_weights(config, seed: int, start: int, end: int, device: str | None, *, routed: bool = True,
                  held: StageParts | None = None) -> dict[str, Tensor | BlockQuantized]:
    """GGUF-named weights of blocks [start, end) of a seeded MLA model (and the embedding / head at the ends),
    routed experts with `routed`, but the parts in `held`."""
    from models.deepseek2 import block_shapes
    from models.moe import ROUTED_WEIGHTS

    held = held or StageParts()
    named: dict[str, tuple[int, ...]] = {}
    if start == 0 and not held.embedding:
        named["token_embd.weight"] = (config.vocab_size, config.dim)
    for i in range(start, end):
        if i not in held.blocks:
            named |= {f"blk.{i}.{n}": s for n, s in block_shapes(config, i).items()
                      if routed or not n.endswith(ROUTED_WEIGHTS)}
    if end == config.num_blocks and not held.head:
        named |= {"output_norm.weight": (config.dim,), "output.weight": (config.vocab_size, config.dim)}
    return {name: q4_0_matrix(seed, name, shape, device) if is_quantized(name, shape)
            else float_tensor(seed, name, shape, device) for name, shape in named.items()}


def expert_weights(config, seed: int, experts: Mapping[int, Sequence[int]],
                   device: str | None) -> dict[str, BlockQuantized]:
    """The routed experts `experts[layer]` of a seeded MLA model, the values `stage_weights` draws for them."""
    from models.deepseek2 import block_shapes
    from models.moe import ROUTED_WEIGHTS

    out = {}
    for layer, es in experts.items():
        for n, shape in block_shapes(config, layer).items():
            if n.endswith(ROUTED_WEIGHTS):
                out[f"blk.{layer}.{n}"] = q4_0_matrix(seed, f"blk.{layer}.{n}", shape, device, groups=list(es))
    return out
