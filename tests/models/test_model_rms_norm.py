"""The hand-written RMSNorm (`models.kernels.rms_norm`): its CUDA source builds for a Hopper GPU without spilling
registers, and, on an NVIDIA GPU, it norms a row (or a window of its columns, read in place) as float64 does, with
bits that do not depend on the rows around it; the norm of a sum gives the sum's and the norm's bits, in one
kernel."""


import numpy as np
import pytest
from tinygrad import Device, Tensor

from models.kernels import cuda
from models.kernels.rms_norm import added_rms_norm, rms_norm, source, threads_for
from tests.models.sm90 import built_without_spills, needs_nvcc

ON_NVIDIA = cuda.arch(Device.DEFAULT) >= 70
EPS = 1e-6


def reference(x: np.ndarray, w: np.ndarray, start: int, width: int) -> np.ndarray:
    part = x[..., start:start + width].astype(np.float64)
    return part / np.sqrt((part ** 2).mean(-1, keepdims=True) + EPS) * w


def test_a_block_of_threads_holds_about_sixteen_values_a_thread():
    assert [threads_for(n) for n in (64, 512, 576, 1536, 7168, 65536)] == [32, 32, 64, 128, 512, 1024]


@needs_nvcc
@pytest.mark.parametrize("stride,start,width", [(7168, 0, 7168), (2112, 1536, 512), (576, 0, 576)])
def test_the_kernel_builds_for_hopper_without_spilling_registers(tmp_path, stride, start, width):
    built_without_spills(source("rms_norm", stride, start, width, EPS), tmp_path)


@needs_nvcc
@pytest.mark.parametrize("width", [7168, 576, 100])
def test_the_norm_of_a_sum_builds_for_hopper_without_spilling_registers(tmp_path, width):
    built_without_spills(source("rms_norm", width, 0, width, EPS, added=True), tmp_path)


def test_the_norm_of_a_sum_is_one_kernel_for_both_outputs(monkeypatch):
    from tinygrad import dtypes
    from tinygrad.helpers import GlobalCounters

    monkeypatch.setattr(cuda, "arch", lambda device: 90)
    x, d, w = (Tensor.empty(*shape, dtype=dtypes.float32, device="NULL").realize() for shape in ((2, 7168), (2, 7168), (7168,)))
    GlobalCounters.reset()
    total, normed = added_rms_norm(x, d, w, EPS)
    (total * 2).realize(normed * 3)
    assert GlobalCounters.kernel_count == 3  # the norm, then the two products


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n,start,width", [(7168, 0, 7168), (2112, 0, 1536), (2112, 1536, 512), (576, 0, 576),
                                           (100, 3, 90)])
def test_it_norms_each_row_or_window_as_float64_does(n, start, width):
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((2, 3, n)) * rng.uniform(0.1, 10, (2, 3, 1))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, width).astype(np.float32)
    got = rms_norm(Tensor(x), Tensor(w), EPS, columns=(start, width)).numpy()
    assert got.shape == (2, 3, width)
    np.testing.assert_allclose(got, reference(x, w, start, width), rtol=2e-6, atol=1e-6)


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_a_rows_bits_do_not_depend_on_the_rows_around_it():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 7168)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 7168).astype(np.float32)
    alone = rms_norm(Tensor(x[4:5]), Tensor(w), EPS).numpy()
    batch = rms_norm(Tensor(x), Tensor(w), EPS).numpy()
    assert np.array_equal(alone[0], batch[4])


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n", [7168, 100])
def test_the_norm_of_a_sum_has_the_bits_of_the_add_then_the_norm(n):
    rng = np.random.default_rng(n)
    x, d = (rng.standard_normal((3, n)).astype(np.float32) for _ in range(2))
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    total, normed = added_rms_norm(Tensor(x), Tensor(d), Tensor(w), EPS)
    assert np.array_equal(total.numpy(), x + d)
    assert np.array_equal(normed.numpy(), rms_norm(Tensor(x + d), Tensor(w), EPS).numpy())
