"""Weights kept in GGML's 32-value blocks (Q4_0, Q4_1, Q8_0) and dequantised inside the kernels that use
them, so a decode step reads 0.56-1.06 bytes per weight instead of float16's 2.

The bytes of each block are only rearranged on the host (scale, offset and codes into separate
arrays); the arithmetic is ggml's: Q8_0 w = q*d, Q4_0 w = (q-8)*d, Q4_1 w = q*d + m, codes of a 4-bit block stored as 16 bytes whose low nibbles are values 0..15 and
high nibbles values 16..31. The products are exact in float32, so the values equal
`tinygrad.llm.gguf.ggml_data_to_tensor`'s bit for bit (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tinygrad import Tensor

BLOCK = 32
# ggml type -> (name, bytes per block)
KERNEL_QUANT_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}


@dataclass
class BlockQuantized:
    """A (rows, cols) matrix as codes `q`, per-block scales `d` and offsets `m` (float16, (rows, cols/32)).
    `q8_1`: the offsets are Q4_1's own (ggml multiplies such a matrix by Q8_1 activations, whose block
    sums meet the offsets); Q4_0 has none, its codes count from `code_offset` 8."""

    q: Tensor  # Q8_0: (rows, cols) int8; Q4_x: (rows, cols/2) uint8, two codes per byte
    d: Tensor
    m: Tensor | None
    cols: int
    q8_1: bool = False
    shape: tuple[int, ...] | None = None  # a stack's shape, e.g. (experts, out, in); None: (rows, cols)
    code_offset: int = 0  # Q4_0: w = (q - 8) * d

    @property
    def packed(self) -> bool:
        return self.q.shape[1] * 2 == self.cols

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def kind(self) -> tuple[bool, bool, bool, int]:
        return self.packed, self.m is not None, self.q8_1, self.code_offset

    def buffers(self) -> list[Tensor]:
        return [t for t in (self.q, self.d, self.m) if t is not None]

    def dequantized(self) -> Tensor:
        """The lazy float32 (rows, cols) matrix (or `shape`); realised only inside the kernels that consume it."""
        return _decode(self.q, self.d, self.m, self.packed, self.cols, self.code_offset).reshape(
            self.shape or (self.rows, self.cols))

    def gathered(self, idx: Tensor) -> Tensor:
        """The lazy float32 (len(idx), out, in) matrices idx of a stack (`shape` (n, out, in)): tinygrad reads
        only the codes of the chosen matrices (a gather by index folds into the kernel's loads)."""
        n, out, cols = self.shape or (1, self.rows, self.cols)

        def pick(t: Tensor) -> Tensor:
            return t.reshape(n, out, t.shape[-1])[idx].reshape(-1, t.shape[-1])

        m = None if self.m is None else pick(self.m)
        return _decode(pick(self.q), pick(self.d), m, self.packed, cols, self.code_offset).reshape(idx.shape[0], out, cols)

    def map_rows(self, fn) -> BlockQuantized:
        """Apply a row rearrangement (e.g. the Q/K RoPE permutation) to codes, scales and offsets alike."""
        return BlockQuantized(fn(self.q), fn(self.d), None if self.m is None else fn(self.m), self.cols, self.q8_1,
                              self.shape, self.code_offset)

    def contiguous(self) -> BlockQuantized:
        """The same blocks in lazy buffers of their own, for the caller to realise (with others at once)."""
        q, d, *m = [t.contiguous() for t in self.buffers()]
        return BlockQuantized(q, d, m[0] if m else None, self.cols, self.q8_1, self.shape, self.code_offset)

    def realize(self) -> BlockQuantized:
        from tinygrad import Tensor

        out = self.contiguous()
        Tensor.realize(*out.buffers())
        return out

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.buffers())

    @staticmethod
    def cat(parts: list[BlockQuantized]) -> BlockQuantized:
        """Stack matrices of the same kind and width along rows."""
        first = parts[0]
        m = first.m.cat(*[p.m for p in parts[1:]]) if first.m is not None else None
        return BlockQuantized(first.q.cat(*[p.q for p in parts[1:]]), first.d.cat(*[p.d for p in parts[1:]]),
                              m, first.cols, first.q8_1, code_offset=first.code_offset).realize()


def _decode(q: Tensor, d: Tensor, m: Tensor | None, packed: bool, cols: int, code_offset: int = 0) -> Tensor:
    """(rows, cols) float32 values of codes q (counted from `code_offset`), scales d and offsets m: ggml's
    arithmetic, exact in float32."""
    from tinygrad import dtypes

    rows, nb = q.shape[0], cols // BLOCK
    if packed:
        codes = q.reshape(rows, nb, 1, BLOCK // 2)
        codes = codes.bitwise_and(15).cat(codes.rshift(4), dim=2)  # (rows, nb, 2, 16): values 0..15, 16..31
    else:
        codes = q.reshape(rows, nb, 2, BLOCK // 2)
    values = codes.cast(dtypes.float32) - code_offset if code_offset else codes.cast(dtypes.float32)
    w = values * d.reshape(rows, nb, 1, 1).cast(dtypes.float32)
    if m is not None:
        w = w + m.reshape(rows, nb, 1, 1).cast(dtypes.float32)
    return w.reshape(rows, cols)


def from_ggml_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], device: str | None) -> BlockQuantized:
    """Split the raw bytes of a Q4_0/Q4_1/Q8_0 tensor into codes, scales and offsets, lazy on `device` (the caller
    realises them, with others at once); a tensor of more than two dimensions (a stack of matrices) is held as
    (rows, last dimension) and keeps its shape."""
    from tinygrad import Tensor

    cols = shape[-1]
    rows = int(np.prod(shape[:-1]))
    _, block_bytes = KERNEL_QUANT_TYPES[ggml_type]
    blocks = raw.reshape(rows, cols // BLOCK, block_bytes)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(rows, -1)
    if ggml_type == 8:  # Q8_0: d, 32 int8 codes
        q, m = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols), None
    elif ggml_type == 2:  # Q4_0: d, 16 bytes of codes; w = (q - 8) * d
        q, m = blocks[..., 2:].reshape(rows, cols // 2), None
    else:  # Q4_1: d, m, 16 bytes of codes; w = q * d + m
        q, m = blocks[..., 4:].reshape(rows, cols // 2), np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(rows, -1)

    def put(a: np.ndarray) -> Tensor:
        return Tensor(np.ascontiguousarray(a), device=device)

    return BlockQuantized(put(q), put(d), None if m is None else put(m), cols, q8_1=ggml_type == 3,
                          shape=tuple(shape) if len(shape) > 2 else None, code_offset=8 if ggml_type == 2 else 0)
