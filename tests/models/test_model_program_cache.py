"""Kernel programs built by one process are found by the next in tinygrad's disk cache (models.tinygrad_ext.program_cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Counts the programs this process builds (tinygrad's own work, not found in any cache), and computes with them.
SCRIPT = """
import json
import os
import time
import tinygrad.codegen as codegen
from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk

keep_compiled_programs_on_disk()
built = []
build = codegen.do_to_program
codegen.do_to_program = lambda *args, **kw: built.append(1) or build(*args, **kw)
from tinygrad import Tensor

time.sleep(max(0.0, float(os.environ.get("START_AT", "0")) - time.time()))  # processes started together compute together
out = ((Tensor.arange(12).reshape(3, 4).float() * 3 + 1).sum(axis=1) / 2).tolist()
print(json.dumps({"built": len(built), "out": out}))
"""


def run_once(cache: Path) -> dict:
    return run_at_once(cache, 1)[0]


def run_at_once(cache: Path, n: int) -> list[dict]:
    """`n` processes computing the same kernels at the same moment (each waits for a common start time)."""
    env = {**os.environ, "CACHEDB": str(cache), "START_AT": str(time.time() + (5.0 if n > 1 else 0.0))}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for _ in range(n)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.splitlines()[-1]))
    return outs


def test_a_second_process_takes_the_kernel_programs_the_first_built_from_the_disk_cache(tmp_path):
    cache = tmp_path / "cache.db"
    first = run_once(cache)
    second = run_once(cache)
    assert first["built"] >= 1  # an empty cache: every program is built
    assert second["built"] == 0  # all found on disk
    assert first["out"] == second["out"] == [11.0, 35.0, 59.0]


def test_processes_missing_the_same_kernels_at_once_build_each_only_once(tmp_path):
    alone = run_once(tmp_path / "alone.db")["built"]
    together = run_at_once(tmp_path / "shared.db", 3)
    assert [t["out"] for t in together] == [[11.0, 35.0, 59.0]] * 3
    assert sum(t["built"] for t in together) == alone  # one built each kernel; the others waited and read it
