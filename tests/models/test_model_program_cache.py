"""Kernel programs built by one process are found by the next in tinygrad's disk cache (models.tinygrad_ext.program_cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Counts the programs this process builds (tinygrad's own work, not found in any cache), and computes with them.
SCRIPT = """
import json
import tinygrad.codegen as codegen
from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk

keep_compiled_programs_on_disk()
built = []
build = codegen.do_to_program
codegen.do_to_program = lambda *args, **kw: built.append(1) or build(*args, **kw)
from tinygrad import Tensor

out = ((Tensor.arange(12).reshape(3, 4).float() * 3 + 1).sum(axis=1) / 2).tolist()
print(json.dumps({"built": len(built), "out": out}))
"""


def run_once(cache: Path) -> dict:
    env = {**os.environ, "CACHEDB": str(cache)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_second_process_takes_the_kernel_programs_the_first_built_from_the_disk_cache(tmp_path):
    cache = tmp_path / "cache.db"
    first = run_once(cache)
    second = run_once(cache)
    assert first["built"] >= 1  # an empty cache: every program is built
    assert second["built"] == 0  # all found on disk
    assert first["out"] == second["out"] == [11.0, 35.0, 59.0]
