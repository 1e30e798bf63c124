"""Fixtures for the swarm tests: a tiny model file and a device benchmark measured once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.swarm.daemons import Daemon, stop_all
from tests.swarm.tiny_model import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def bench_file(tmp_path_factory) -> Path:
    """The real micro-benchmark, run once; daemons get a copy so each does not measure again."""
    from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

    home = tmp_path_factory.mktemp("bench")
    device = resolve_device("auto")
    load_or_measure(home, device, device_name(device))
    return home / BENCH_FILE


@pytest.fixture
def daemons(tmp_path, tiny_model, bench_file):
    """A factory of real daemons on loopback; every one still running is stopped at the end."""
    made: list[Daemon] = []

    def make(name: str, **kw) -> Daemon:
        d = Daemon(tmp_path / name, tiny_model, bench_file=bench_file, **kw)
        made.append(d)
        return d

    yield make
    stop_all(made)
