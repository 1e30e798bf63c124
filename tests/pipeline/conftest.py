"""Fixtures for the pipeline tests: tinygrad usable from any thread, a device benchmark measured once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def kernel_cache_per_thread(tinygrad_in_process) -> None:
    """Tests run tinygrad on their own thread and stages on a compute thread: each gets its own connection
    to tinygrad's kernel cache (as a daemon's compute thread does)."""
    from swarmd.inference.compute import use_a_kernel_cache_connection_per_thread

    use_a_kernel_cache_connection_per_thread()


@pytest.fixture(scope="session")
def bench_file(tmp_path_factory) -> Path:
    from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

    home = tmp_path_factory.mktemp("bench")
    device = resolve_device("auto")
    load_or_measure(home, device, device_name(device))
    return home / BENCH_FILE
