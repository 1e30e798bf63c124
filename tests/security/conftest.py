"""Fixtures for the security tests: real `swarmd join` processes, as tests/swarm starts them."""

from __future__ import annotations

import pytest

from tests.swarm.daemons import Daemon, stop_all
from tests.swarm.tiny_model import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_file(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def measured_bench(tmp_path_factory):
    """The device micro-benchmark, measured once; each daemon gets a copy instead of measuring again."""
    from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

    home = tmp_path_factory.mktemp("bench")
    device = resolve_device("auto")
    load_or_measure(home, device, device_name(device))
    return home / BENCH_FILE


@pytest.fixture
def private_daemons(tmp_path, tiny_model_file, measured_bench):
    """`make(name, *extra_args)`: a daemon on loopback; every one still running is stopped at the end."""
    made: list[Daemon] = []

    def make(name: str, *extra: str) -> Daemon:
        d = Daemon(tmp_path / name, tiny_model_file, bench_file=measured_bench, extra=extra)
        made.append(d)
        return d

    yield make
    stop_all(made)
