"""The hand-written product with a float16 or float32 matrix (`models.kernels.float_gemv`, a router's at decode): its
CUDA source builds for a Hopper GPU without spilling registers, and, on an NVIDIA GPU, it is the float64 product,
with bits that do not depend on the rows around a row."""


import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes

from models.kernels import cuda
from models.kernels.float_gemv import float_gemv, float_gemv_fits, source
from tests.models.sm90 import built_without_spills, needs_nvcc

ON_NVIDIA = cuda.arch(Device.DEFAULT) >= 70


@needs_nvcc
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("itemsize", [2, 4], ids=["float16", "float32"])
def test_the_kernel_builds_for_hopper_without_spilling_registers(tmp_path, rows, itemsize):
    built_without_spills(source("float_gemv", rows, 384, 7168, itemsize), tmp_path)


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.float32])
def test_it_takes_a_few_rows_times_a_float_matrix(monkeypatch, dtype):
    monkeypatch.setattr(cuda, "arch", lambda device: 90)
    w = Tensor.empty(384, 7168, dtype=dtype)
    assert float_gemv_fits(Tensor.empty(1, 7168), w) and float_gemv_fits(Tensor.empty(7, 7168), w)
    assert not float_gemv_fits(Tensor.empty(8, 7168), w)  # the tensor cores' from 8 rows
    assert not float_gemv_fits(Tensor.empty(1, 7168), w.cast(dtypes.int8))
    assert not float_gemv_fits(Tensor.empty(1, 7164), Tensor.empty(384, 7164, dtype=dtype))


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("width", [7168, 448], ids=["kimi-k2", "kimi-k2-mini"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_it_is_the_product_and_a_rows_bits_do_not_depend_on_the_rows_around_it(width, dtype):
    rng = np.random.default_rng(width)
    w = (rng.standard_normal((384, width)) * 0.05).astype(dtype)
    x = rng.standard_normal((5, width)).astype(np.float32)
    got = float_gemv(Tensor(x), Tensor(w)).numpy()
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    assert np.array_equal(float_gemv(Tensor(x[3:4].copy()), Tensor(w)).numpy()[0], got[3])
