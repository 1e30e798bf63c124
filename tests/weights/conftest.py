"""Fixtures for the weights tests' real daemons: a device benchmark measured once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bench_file(tmp_path_factory) -> Path:
    """The real micro-benchmark, run once; daemons get a copy so each does not measure again."""
    from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

    home = tmp_path_factory.mktemp("bench")
    device = resolve_device("auto")
    load_or_measure(home, device, device_name(device))
    return home / BENCH_FILE


@pytest.fixture(scope="session")
def want(smollm2_gguf) -> list[int]:
    """SmolLM2's greedy answer, whole, in this process (computed before any daemon starts: its kernels are
    compiled once, and the daemons find them in the shared kernel cache)."""
    from tests.weights.cache_swarm import greedy

    return greedy(smollm2_gguf)
