"""The hand-written latent attention of a decode batch (`models.kernels.latent_attention`): its CUDA sources build for
a Hopper GPU without spilling registers, and, on an NVIDIA GPU, each row attends over its own slot up to its own
position, as a float64 softmax does, with bits that do not depend on the rows around it."""

import shutil
import subprocess

import numpy as np
import pytest
from tinygrad import Device, Tensor

from models.kernels import cuda
from models.kernels.latent_attention import _COMBINE, _PART, HEADS_PER_BLOCK, SPLITS, latent_attention

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


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs CUDA's compiler")
def test_the_kernels_build_for_hopper_without_spilling_registers(tmp_path):
    consts = dict(H=64, W=576, V=512, ROWS=4160, NS=SPLITS, HPB=HEADS_PER_BLOCK, SCALE="0.0625")
    for name, text in (("part", _PART), ("sum", _COMBINE)):
        (tmp_path / f"{name}.cu").write_text(text.format(NAME=name, **consts))
        built = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / f"{name}.cubin"),
                                str(tmp_path / f"{name}.cu")], capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
        assert "0 bytes spill stores" in built.stderr


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
