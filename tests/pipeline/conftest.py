"""Fixtures for the pipeline tests: a device benchmark measured once, copied into each daemon's home."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bench_file(tmp_path_factory) -> Path:
    from swarmd.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device
    from swarmd.model_thread import call_model

    home = tmp_path_factory.mktemp("bench")
    device = resolve_device("auto")
    call_model(load_or_measure, home, device, device_name(device))
    return home / BENCH_FILE
