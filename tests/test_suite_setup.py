"""The suite's own setup: a folder that runs no model pays for no tinygrad."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys, pytest
class Probe:
    def pytest_sessionfinish(self, session):
        print("loaded:", ",".join(m for m in ("tinygrad", "models.stage") if m in sys.modules) or "none")
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "tests/planner/test_golden.py"], plugins=[Probe()]))
"""


def test_the_planner_tests_run_without_importing_tinygrad():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loaded: none" in done.stdout, done.stdout
