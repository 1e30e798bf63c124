"""Fixtures for the network-namespace tests: a device benchmark measured once; namespaces need root."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.netns.topology import missing_tools


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = missing_tools()
    if why:
        for item in items:
            if "tests/netns/" in str(item.fspath).replace("\\", "/"):
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def bench_file(tmp_path_factory) -> Path:
    from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

    home = tmp_path_factory.mktemp("bench")
    device = resolve_device("auto")
    load_or_measure(home, device, device_name(device))
    return home / BENCH_FILE
