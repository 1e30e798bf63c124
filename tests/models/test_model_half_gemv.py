"""The hand-written product with a float16 matrix (`models.kernels.half_gemv`, a router's at decode): its CUDA source
builds for a Hopper GPU without spilling registers, and, on an NVIDIA GPU, it is the float64 product, with bits
that do not depend on the rows around a row."""


import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes

from models.kernels import cuda
from models.kernels.half_gemv import half_gemv, half_gemv_fits, source
from tests.models.sm90 import built_without_spills, needs_nvcc

ON_NVIDIA = cuda.arch(Device.DEFAULT) >= 70


@needs_nvcc
@pytest.mark.parametrize("rows", [1, 7])
def test_the_kernel_builds_for_hopper_without_spilling_registers(tmp_path, rows):
    built_without_spills(source("half_gemv", rows, 384, 7168), tmp_path)


def test_it_takes_a_few_rows_times_a_float16_matrix(monkeypatch):
    monkeypatch.setattr(cuda, "arch", lambda device: 90)
    w = Tensor.empty(384, 7168, dtype=dtypes.float16)
    assert half_gemv_fits(Tensor.empty(1, 7168), w) and half_gemv_fits(Tensor.empty(7, 7168), w)
    assert not half_gemv_fits(Tensor.empty(8, 7168), w)  # the tensor cores' from 8 rows
    assert not half_gemv_fits(Tensor.empty(1, 7168), w.float())
    assert not half_gemv_fits(Tensor.empty(1, 7164), Tensor.empty(384, 7164, dtype=dtypes.float16))


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("width", [7168, 448], ids=["kimi-k2", "kimi-k2-mini"])
def test_it_is_the_product_and_a_rows_bits_do_not_depend_on_the_rows_around_it(width):
    rng = np.random.default_rng(width)
    w = (rng.standard_normal((384, width)) * 0.05).astype(np.float16)
    x = rng.standard_normal((5, width)).astype(np.float32)
    got = half_gemv(Tensor(x), Tensor(w)).numpy()
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    assert np.array_equal(half_gemv(Tensor(x[3:4].copy()), Tensor(w)).numpy()[0], got[3])
