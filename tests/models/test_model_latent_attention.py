"""The hand-written latent attention of a decode batch (`models.kernels.latent_attention`): its CUDA sources build for
a Hopper GPU without spilling registers, and, on an NVIDIA GPU, each row attends over its own slot up to its own
position, as a float64 softmax does, with bits that do not depend on the rows around it."""


import numpy as np
import pytest
from tinygrad import Device, Tensor

from models.kernels import cuda
from models.kernels.latent_attention import (
    _COMBINE,
    _PART,
    _ROPE_PARAMS,
    HEADS_PER_BLOCK,
    ROTATED,
    SPLITS,
    QueryRope,
    latent_attention,
)
from tests.models.sm90 import built_without_spills, needs_nvcc

ON_NVIDIA = cuda.arch(Device.DEFAULT) >= 70
HEADS, WIDTH, VALUES, ROWS, SLOTS = 16, 192, 128, 300, 4


def reference(q: np.ndarray, cache: np.ndarray, slots: list[int], starts: list[int], scale: float) -> np.ndarray:
    out = []
    for b, (s, p) in enumerate(zip(slots, starts, strict=True)):
        keys = cache[s, :p + 1].astype(np.float64)
        scores = q[b].astype(np.float64) @ keys.T * scale
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out.append((w / w.sum(-1, keepdims=True)) @ keys[:, :VALUES])
    return np.stack(out)


def attend(q: np.ndarray, cache: np.ndarray, slots: list[int], starts: list[int], scale: float) -> np.ndarray:
    return latent_attention(Tensor(q), Tensor(cache), Tensor(np.array(slots, np.int32)),
                            Tensor(np.array(starts, np.int32)), values=VALUES, scale=scale).numpy()


@needs_nvcc
@pytest.mark.parametrize("rope", [False, True], ids=["query-joined", "query-rope-in-kernel"])
def test_the_kernels_build_for_hopper_without_spilling_registers(tmp_path, rope):
    consts = dict(H=64, W=576, V=512, ROWS=4160, NS=SPLITS, HPB=HEADS_PER_BLOCK, SCALE="0.0625", ROPE=int(rope),
                  HD=192, START=128, PARAMS=_ROPE_PARAMS if rope else "", ROTATED=ROTATED)
    for name, text in (("part", _PART), ("sum", _COMBINE)):
        built_without_spills(text.format(NAME=name, **consts), tmp_path, name)


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_each_row_attends_over_its_own_slot_up_to_its_own_position():
    rng = np.random.default_rng(3)
    cache = rng.standard_normal((SLOTS, ROWS, WIDTH)).astype(np.float32)
    # rows in distinct slots; two rows of one slot at consecutive positions (a verify step's); fewer rows than spans
    slots, starts = [2, 0, 1, 1, 3], [0, 299, 40, 41, 7]
    q = rng.standard_normal((len(slots), HEADS, WIDTH)).astype(np.float32) * 0.2
    got = attend(q, cache, slots, starts, 0.07)
    want = reference(q, cache, slots, starts, 0.07)
    assert got.shape == (len(slots), HEADS, VALUES)
    assert np.abs(got - want).max() < 2e-5 * np.abs(want).max()


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_a_rows_bits_do_not_depend_on_the_rows_around_it():
    rng = np.random.default_rng(4)
    cache = rng.standard_normal((SLOTS, ROWS, WIDTH)).astype(np.float32)
    slots, starts = [3, 1, 0, 2], [120, 5, 299, 64]
    q = rng.standard_normal((len(slots), HEADS, WIDTH)).astype(np.float32)
    whole = attend(q, cache, slots, starts, 0.1)
    for b in range(len(slots)):
        alone = attend(q[b:b + 1].copy(), cache, slots[b:b + 1], starts[b:b + 1], 0.1)
        assert np.array_equal(whole[b], alone[0])


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_queries_rotated_in_the_kernel_attend_as_queries_rotated_first():
    """The RoPE part read where the projection left it (heads of 96 values, 32 of them unrotated first) and rotated in
    the kernel: the reference rotates it in float32, each product and sum rounded, and joins it to the latent part."""
    rng = np.random.default_rng(5)
    rope, head_dim, nope = WIDTH - VALUES, 96, 32
    cache = rng.standard_normal((SLOTS, ROWS, WIDTH)).astype(np.float32)
    slots, starts = [1, 3, 0], [17, 250, 299]
    latent = (rng.standard_normal((3, HEADS, VALUES)) * 0.2).astype(np.float32)
    heads = (rng.standard_normal((3, HEADS, head_dim)) * 0.2).astype(np.float32)
    half = rope // 2
    angles = rng.uniform(-1, 1, (3, rope)).astype(np.float32)
    cos, sin = angles[:, None, :half], angles[:, None, half:]
    x1, x2 = heads[..., nope:nope + half], heads[..., nope + half:nope + rope]
    rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # float32, no fused steps
    joined = attend(np.concatenate([latent, rotated], axis=-1), cache, slots, starts, 0.07)
    got = latent_attention(Tensor(latent), Tensor(cache), Tensor(np.array(slots, np.int32)),
                           Tensor(np.array(starts, np.int32)), values=VALUES, scale=0.07,
                           rope=QueryRope(Tensor(heads), nope, Tensor(angles))).numpy()
    assert np.array_equal(got, joined)
