"""llama.cpp's CPU arithmetic, for stages that must give the same greedy tokens as llama.cpp on a GGUF.

ggml's CPU backend does not multiply float activations by block-quantised weights: before each such
product it quantises the activation rows to 8 bits in blocks of 32 values (Q8_0 for Q4_0/Q8_0
weights, Q8_1 for Q4_1: scale d = max|x|/127 stored as float16, codes round(x/d)), and the product
of the exact integer codes is scaled back. It also keeps the KV cache in float16 and, without flash
attention (llama-cpp-python's default), converts the query and the softmax probabilities to float16
for their products with the cache. Each of these moves SmolLM2-135M's logits by up to a few tenths
(measured in docs/BENCHMARKS.md, "Fidelity against llama.cpp"), enough to flip greedy steps whose
top-1/top-2 gap is ~0.3; a float implementation cannot follow llama.cpp through them, this one does.

The quantised activations are multiplied in their dequantised form (codes times the float16 scale,
exact in float32) by the matvec of the float path: its products and sums equal ggml's integer dot
products up to float32 rounding. What that form leaves out is Q8_1's block sum: ggml stores
s = d*sum(codes) rounded to float16 and multiplies it by Q4_1's offsets, so the offsets see s, not
the sum of the dequantised values; `matvec` adds the difference. It is small per block but the same
sign over many rows, and it alone moved greedy tokens (measured).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from models.kernels.cpu_gemv import cpu_gemv, cpu_gemv_fits
from models.kernels.matvec import matvec as float_matvec

if TYPE_CHECKING:
    from tinygrad import Tensor

    from models.kernels.quant import BlockQuantized

BLOCK = 32
Q8_MAX = 127.0


def q8_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (rows, n) quantised to 8 bits per block of 32 values as ggml's `quantize_row_q8_1` (AVX2) does:
    the values the codes stand for (rows, n), and per block (rows, n/32) how far Q8_1's float16 block
    sum lies from their sum. Ties round to even, as `_mm256_round_ps` does."""
    rows, n = x.shape
    blocks = x.reshape(rows, n // BLOCK, BLOCK)
    amax = blocks.abs().max(-1, keepdim=True)
    d = amax / Q8_MAX
    codes = (blocks * (amax > 0).where(Q8_MAX / amax, 0.0)).round()
    d16 = round_f16(d)
    sums = codes.sum(-1, keepdim=True)
    sum_error = round_f16(d * sums) - d16 * sums
    return (codes * d16).reshape(rows, n), sum_error.reshape(rows, n // BLOCK)


def matvec(x: Tensor, w: Tensor, blocks: BlockQuantized) -> Tensor:
    """x (rows, in) @ w.T as ggml computes it for a matrix in GGML blocks (`w`, its dequantised form):
    the activations quantised to 8 bits (Q8_0, or Q8_1 for Q4_1 matrices, which also bring their
    rounded block sums to the matrix's offsets)."""
    from tinygrad import dtypes

    values, sum_error = q8_activations(x)
    y = cpu_gemv(values, blocks) if cpu_gemv_fits(values, blocks) else float_matvec(values, w)
    if blocks.q8_1 and blocks.m is not None:
        y = y + sum_error @ blocks.m.cast(dtypes.float32).transpose()  # (rows, in/32) @ (in/32, out): small
    return y


def round_f16(x: Tensor) -> Tensor:
    """x rounded to float16 precision and kept in float32 (what ggml's conversions to F16 do)."""
    from tinygrad import dtypes

    return x.cast(dtypes.float16).cast(dtypes.float32)


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax attention as ggml's CPU backend computes it without flash attention: q (B, H, T, hd) in
    float32, keys/values (B, KVH, S, hd) from a float16 cache; q and the probabilities are rounded to
    float16 before their products, which accumulate in float32. Query head h uses KV head h // (H/KVH), whose query
    heads are rows of its products (`models.kernels.attention.query_rows`)."""
    from tinygrad import dtypes

    from models.kernels.attention import heads_of, masked_rows, query_rows

    queries = query_rows(round_f16(q), keys.shape[1])
    scores = (queries * keys.cast(dtypes.float32).unsqueeze(2)).sum(-1) * (1.0 / math.sqrt(q.shape[-1]))
    weights = round_f16(masked_rows(scores, mask, q.shape[2]).softmax(-1))
    return heads_of(weights, values.cast(dtypes.float32), q.shape)
