"""The hand-written tensor-core product (`models.kernels.gemm`): which products take it, that its CUDA source builds
for a Hopper GPU within its registers and shared memory, and, on an NVIDIA GPU, that it is the float32 product of its
float16 operands."""

import re
from dataclasses import replace

import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes
from tinygrad.uop.ops import Ops

from models.kernels import cuda
from models.kernels.gemm import BATCH_TILING, CHUNK_TILING, Tiling, gemm, gemm_fits, source, tiling
from models.kernels.matvec import tensor_core_matmul
from tests.models.sm90 import built_without_spills, needs_nvcc

TILINGS = [CHUNK_TILING, BATCH_TILING, replace(BATCH_TILING, split=8), Tiling.parse("128,128,32,2,4,3")]


def programs(t: Tensor) -> list[str]:
    return [u.arg.name for u in t.uop.toposort() if u.op is Ops.PROGRAM]


def test_a_tiling_must_fit_a_kernels_declared_shared_memory_and_split_evenly_over_its_warps():
    assert all(t.valid() and t.shared_bytes <= 48 * 1024 for t in TILINGS)
    assert not Tiling.parse("128,128,64,2,2,3").valid()  # 96 KiB of shared memory
    assert not Tiling.parse("64,128,32,8,2,3").valid()  # warp tiles of 8 rows: less than an mma tile
    assert not Tiling.parse("64,128,48,2,2,3").valid()  # a depth that is not whole 16-byte chunk rows


def test_products_of_eight_rows_and_more_take_the_hand_written_kernel_on_nvidia_gpus(monkeypatch):
    monkeypatch.setattr(cuda, "arch", lambda device: 90 if device == "NULL" else 0)
    w = Tensor.empty(4096, 4096, dtype=dtypes.float16, device="NULL")

    def kernels(rows: int, w: Tensor = w) -> list[str]:
        return [n for n in programs(tensor_core_matmul(Tensor.empty(rows, 4096, device="NULL"), w))
                if n.startswith("gemm_")]

    assert kernels(512) == ["gemm_512_4096_4096_64x128x64w2x2s2"]  # a prompt chunk
    assert kernels(32) == ["gemm_32_4096_4096_32x64x64w1x2s3p8"]  # a decode batch: the reduction in 8 parts
    assert kernels(8) == ["gemm_8_4096_4096_32x64x64w1x2s3p8"]
    # the more tiles of outputs, the fewer parts; each part whole steps of the tile's depth
    assert [tiling(32, out, 4096).split for out in (4096, 6144, 28672, 128256)] == [8, 4, 1, 1]
    assert tiling(32, 4096, 14336).split == 8 and tiling(32, 4096, 1280).split == 4
    assert kernels(4100, Tensor.empty(4100, 4096, dtype=dtypes.float16, device="NULL")) == []  # not whole tiles
    monkeypatch.setenv("SWARMD_GEMM_MIN_ROWS", "64")
    assert kernels(32) == [] and kernels(64) == ["gemm_64_4096_4096_64x128x64w2x2s2"]
    monkeypatch.setenv("SWARMD_GEMM", "0")
    assert kernels(512) == []
    assert not gemm_fits("CPU", 512, 4096, 4096)


@needs_nvcc
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
def test_the_kernel_builds_for_hopper_without_spilling_registers(tiling, tmp_path):
    report = built_without_spills(source("gemm_check", 100, 4096, 4096, tiling), tmp_path)
    assert int(re.search(r"(\d+) bytes smem", report).group(1)) == tiling.shared_bytes


@pytest.mark.skipif(cuda.arch(Device.DEFAULT) < 80, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows", [64, 100, 512])
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
def test_the_hand_written_product_is_the_float32_product_of_its_float16_operands(rows, tiling):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 1024)).astype(np.float16)
    w = (rng.standard_normal((768, 1024)) * 0.05).astype(np.float16)
    out = gemm(Tensor(x), Tensor(w), tiling).numpy()
    want = x.astype(np.float32) @ w.astype(np.float32).T
    assert out.shape == (rows, 768)
    assert np.abs(out - want).max() < 1e-4 * np.abs(want).max()  # float32 sums, in another order
