"""The router's top-k as a hand-written kernel (`models.kernels.top_k`): its CUDA source builds for a Hopper GPU
without spilling registers, and, on an NVIDIA GPU, it picks what `models.moe.top_k`'s tinygrad kernels pick."""

import shutil
import subprocess

import numpy as np
import pytest
from tinygrad import Device, Tensor

from models.kernels import cuda
from models.kernels.top_k import _SOURCE, top_k_kernel

ON_NVIDIA = cuda.arch(Device.DEFAULT) >= 70


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs CUDA's compiler")
def test_the_kernel_builds_for_hopper_without_spilling_registers(tmp_path):
    (tmp_path / "top_k.cu").write_text(_SOURCE.format(NAME="top_k", ROWS=8, N=1024, K=8, PER=32, RPB=4))
    built = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                            str(tmp_path / "top_k.cu")], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert "0 bytes spill stores" in built.stderr


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n,k", [(384, 8), (256, 8), (40, 2)])
def test_it_picks_what_tinygrads_kernels_pick(n, k, monkeypatch):
    from models.moe import top_k

    rng = np.random.default_rng(n)
    x = rng.integers(0, 4, (9, n)).astype(np.float32)  # many ties
    x[3, :] = -np.inf  # a row of a group left out (DeepSeek-V3's group-limited routing)
    x[4, 5::7] = -np.inf
    got = top_k_kernel(Tensor(x), k).numpy()
    monkeypatch.setenv("SWARMD_TOP_K_KERNEL", "0")
    assert np.array_equal(got, top_k(Tensor(x), k).numpy())
