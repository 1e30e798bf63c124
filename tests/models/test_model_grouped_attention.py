"""Grouped-query attention with a KV head's query heads as rows of its products: exactly the arithmetic of attention
over repeated KV heads (`scaled_dot_product_attention(enable_gqa=True)`, and ggml's with its float16 roundings), bit
for bit, for a decoded token and for a chunk of a prompt under its causal mask."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from models.kernels import ggml_numerics
from models.kernels.attention import grouped_query_attention

HEADS, KV_HEADS, HEAD_DIM, CACHED = 9, 3, 64, 40


def inputs(T: int, cache_dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    rng = np.random.default_rng(seed)
    rows = CACHED + T
    q = Tensor(rng.standard_normal((1, HEADS, T, HEAD_DIM)).astype(np.float32))
    keys = Tensor(rng.standard_normal((1, KV_HEADS, rows, HEAD_DIM)).astype(np.float32)).cast(cache_dtype)
    values = Tensor(rng.standard_normal((1, KV_HEADS, rows, HEAD_DIM)).astype(np.float32)).cast(cache_dtype)
    mask = None if T == 1 else Tensor.full((1, 1, T, rows), float("-inf")).triu(CACHED + 1)
    return q, keys, values, mask


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("cache_dtype", [dtypes.float32, dtypes.float16])
def test_grouped_query_attention_is_attention_over_repeated_kv_heads_bit_for_bit(T: int, cache_dtype) -> None:
    q, keys, values, mask = inputs(T, cache_dtype)
    want = q.scaled_dot_product_attention(keys, values, attn_mask=mask, enable_gqa=True).numpy()
    got = grouped_query_attention(q, keys, values, mask).numpy()
    assert got.shape == want.shape == (1, HEADS, T, HEAD_DIM)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("T", [1, 5])
def test_ggml_attention_is_its_arithmetic_over_repeated_kv_heads_bit_for_bit(T: int) -> None:
    q, keys, values, mask = inputs(T, dtypes.float16, seed=1)
    group = HEADS // KV_HEADS
    repeated_keys = keys.cast(dtypes.float32).repeat_interleave(group, dim=1)
    repeated_values = values.cast(dtypes.float32).repeat_interleave(group, dim=1)
    scores = ggml_numerics.round_f16(q) @ repeated_keys.transpose(-1, -2) * (1.0 / math.sqrt(HEAD_DIM))
    if mask is not None:
        scores = scores + mask
    want = (ggml_numerics.round_f16(scores.softmax(-1)) @ repeated_values).numpy()
    got = ggml_numerics.attention(q, keys, values, mask).numpy()
    np.testing.assert_array_equal(got, want)
