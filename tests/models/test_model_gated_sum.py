"""The hand-written gated sum (`models.kernels.gated_sum`): its CUDA source builds for a Hopper GPU, and on an NVIDIA
GPU a MoE block's residual plus its rows' gated expert outputs has the bits of a swarm's host adding the experts'
answers (`models.moe.gated_sum`) to the residual."""


import numpy as np
import pytest
from tinygrad import Device, Tensor

from models.kernels import cuda
from models.kernels.gated_sum import residual_plus_gated, source
from models.moe import ExpertCall, gated_sum
from tests.models.sm90 import built_without_spills, needs_nvcc

ON_NVIDIA = cuda.arch(Device.DEFAULT) >= 70


@needs_nvcc
@pytest.mark.parametrize("shared", [0, 1, 2])
def test_the_kernel_builds_for_hopper(tmp_path, shared):
    built_without_spills(source("gated_sum", 8, 8, 7168, shared), tmp_path)


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows,k,dim", [(1, 8, 7168), (8, 8, 7168), (3, 2, 100)])
@pytest.mark.parametrize("with_shared", [False, True, "after"])
def test_the_sum_has_the_bits_of_the_hosts_sum_added_to_the_residual(rows, k, dim, with_shared):
    """With the shared experts' output, the residual plus it first, as a stage whose graph is cut adds them; the same
    with each row's shared output after the rows' expert outputs, in their buffer (the experts' products made it)."""
    rng = np.random.default_rng(rows * k)
    h = rng.standard_normal((rows, dim)).astype(np.float32)
    outputs = rng.standard_normal((rows, k, dim)).astype(np.float32)
    gates = rng.random((rows, k)).astype(np.float32)
    shared = rng.standard_normal((rows, dim)).astype(np.float32) if with_shared else None
    call = ExpertCall(1, np.zeros((rows, dim), np.float32), np.zeros((rows, k), np.int32), gates)
    expected = (h if shared is None else h + shared) + gated_sum(call, outputs.reshape(rows * k, dim))
    if with_shared == "after":
        got = residual_plus_gated(Tensor(h).reshape(rows, 1, dim), Tensor(np.concatenate([outputs.reshape(-1, dim), shared])),
                                  Tensor(gates).reshape(rows, 1, k), shared_after=True).numpy()
    else:
        got = residual_plus_gated(Tensor(h).reshape(rows, 1, dim), Tensor(outputs).reshape(rows, 1, k, dim),
                                  Tensor(gates).reshape(rows, 1, k),
                                  None if shared is None else Tensor(shared).reshape(rows, 1, dim)).numpy()
    np.testing.assert_array_equal(got.reshape(rows, dim), expected)
