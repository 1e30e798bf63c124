"""A hand-written kernel's CUDA source built for a Hopper GPU (sm_90) with CUDA's own compiler, where it is installed:
the checks the kernel tests run on any machine."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

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
