"""A hand-written kernel's CUDA source built for a Hopper GPU (sm_90) with CUDA's own compiler, where it is installed:
the checks the kernel tests run on any machine; and the code paths written for such a GPU taken on another device
(a stage's graph scheduled or captured as the GPU would run it)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs CUDA's compiler")


def built_without_spills(source: str, where: Path, name: str = "kernel") -> str:
    """Builds `source` for sm_90 in `where`, asserts that it built and spills no registers; returns ptxas's report."""
    cu = where / f"{name}.cu"
    cu.write_text(source)
    built = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(where / f"{name}.cubin"),
                            str(cu)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert "0 bytes spill stores" in built.stderr
    return built.stderr


def take_gpu_paths(device: str, patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """From now on `device` takes the code paths written for NVIDIA GPUs, and the hand-written kernels' checks
    answer as on an sm_90 GPU (an H100 / H200). `patch` sets each attribute (a test's `monkeypatch.setattr`
    undoes it afterwards)."""
    import models.kernels.attention
    import models.kernels.gathered
    import models.kernels.matvec
    import models.stage
    from models.kernels import cuda

    patch(cuda, "arch", lambda _device: 90)
    for module in (models.kernels.attention, models.kernels.gathered, models.kernels.matvec, models.stage):
        if device not in module.GPU_DEVICES:
            patch(module, "GPU_DEVICES", (*module.GPU_DEVICES, device))
