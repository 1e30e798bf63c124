"""A pytest plugin that sums, per test module, the CPU time its tests took: the pytest process's and that of the
processes it started and has reaped (daemons stopped by the module's teardown count for the module).

The suite is bound by CPU work on a small machine; the census says which modules to make cheaper.

    PYTHONPATH=scripts .venv/bin/python -m pytest -p cpu_census tests ...

Writes `cpu-census.log` (or `$CPU_CENSUS`): a line per module, the most CPU first (CPU seconds, wall seconds,
their ratio, tests), then the total; under pytest-xdist, one file per worker (`cpu-census.log.gw0`, ...).
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict

import pytest

_cpu: dict[str, float] = defaultdict(float)
_wall: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    module = item.nodeid.split("::")[0]
    _cpu[module] += _cpu_seconds() - cpu
    _wall[module] += time.monotonic() - wall
    _tests[module] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("CPU_CENSUS", "cpu-census.log")
    if worker := os.environ.get("PYTEST_XDIST_WORKER"):  # each pytest-xdist worker counts its own modules
        path = f"{path}.{worker}"
    with open(path, "w") as log:
        for module in sorted(_cpu, key=_cpu.get, reverse=True):
            ratio = _cpu[module] / _wall[module] if _wall[module] else 0.0
            print(f"{_cpu[module]:8.1f} s CPU {_wall[module]:8.1f} s wall {ratio:5.2f} {_tests[module]:4d} {module}",
                  file=log)
        print(f"{sum(_cpu.values()):8.1f} s CPU {sum(_wall.values()):8.1f} s wall in all", file=log)
