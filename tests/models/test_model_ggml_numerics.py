"""ggml numerics: 8-bit activations and GGML-block products exactly as ggml's CPU code computes them.

The expected values are written here in numpy from ggml's definitions (quantize_row_q8_1 and
ggml_vec_dot_q4_1_q8_1 / q8_0_q8_0 on the raw block bytes: integer dot products per block, scaled by
the float16 scales, Q8_1's float16 block sum times Q4_1's offset), independently of models/kernels/quant.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from models.kernels import ggml_numerics
from models.kernels.quant import from_ggml_blocks

pytestmark = pytest.mark.slow


def ggml_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_1 (AVX2): per block of 32, codes, the float16 scale and the float16 block sum."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.round(blocks * inv[..., None])  # numpy rounds ties to even, as _mm256_round_ps
    return codes, d.astype(np.float16), (d * codes.sum(-1)).astype(np.float16)


def q4_1_bytes(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    blocks = np.zeros((rows, cols // 32, 20), np.uint8)
    blocks[..., 0:2] = (rng.uniform(0.01, 0.03, (rows, cols // 32, 1))).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = (-8 * rng.uniform(0.01, 0.03, (rows, cols // 32, 1))).astype(np.float16).view(np.uint8)
    blocks[..., 4:] = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    return blocks.reshape(-1)


def q4_1_dot(raw: np.ndarray, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_q4_1_q8_1 for each weight row and each activation row."""
    blocks = raw.reshape(rows, cols // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], axis=-1).astype(np.float32)
    qx, dx, sx = ggml_q8(x)
    dots = np.einsum("rbk,tbk->trb", codes, qx)  # exact: small integers
    return (d[None] * dx[:, None].astype(np.float32) * dots + m[None] * sx[:, None].astype(np.float32)).sum(-1)


def test_activations_are_quantised_as_ggml_does():
    from tinygrad import Tensor

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 96)) * [[1], [30], [1e-3]]).astype(np.float32)
    x[1, 32:64] = 0  # a block of zeros has scale 0 and codes 0
    values, sum_error = ggml_numerics.q8_activations(Tensor(x))
    codes, d, s = ggml_q8(x)
    want = codes * d.astype(np.float32)[..., None]
    np.testing.assert_array_equal(values.numpy(), want.reshape(x.shape))
    np.testing.assert_array_equal(sum_error.numpy() + want.sum(-1), s.astype(np.float32))


def test_a_q4_1_matrix_multiplies_as_ggml_vec_dot_q4_1_q8_1():
    from tinygrad import Tensor

    rng = np.random.default_rng(1)
    rows, cols = 48, 128
    raw = q4_1_bytes(rng, rows, cols)
    blocks = from_ggml_blocks(raw, 3, (rows, cols), None)
    x = rng.standard_normal((2, cols)).astype(np.float32) * 4
    got = ggml_numerics.matvec(Tensor(x), blocks.dequantized(), blocks).numpy()
    want = q4_1_dot(raw, rows, cols, x)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)  # float32 sums in another order
    plain = x @ blocks.dequantized().numpy().T
    assert np.abs(plain - want).max() > 100 * np.abs(got - want).max()  # the 8-bit activations matter


def test_attention_rounds_the_query_and_the_probabilities_to_float16():
    from tinygrad import Tensor

    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 3, 64)).astype(np.float32) * 3
    k = rng.standard_normal((1, 2, 3, 64)).astype(np.float16) * 3
    v = rng.standard_normal((1, 2, 3, 64)).astype(np.float16)
    mask = np.triu(np.full((3, 3), -np.inf, np.float32), k=1)

    def f16(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float16).astype(np.float32)

    keys, values = np.repeat(k.astype(np.float32), 2, axis=1), np.repeat(v.astype(np.float32), 2, axis=1)
    scores = f16(q) @ keys.transpose(0, 1, 3, 2) * 0.125 + mask
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = f16(probs / probs.sum(-1, keepdims=True)) @ values
    got = ggml_numerics.attention(Tensor(q), Tensor(k), Tensor(v), Tensor(mask).reshape(1, 1, 3, 3)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
