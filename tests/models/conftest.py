"""Fixtures for model tests: tiny GGUF models written in the test, the numpy reference importable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/reference/ holds the numpy reference forward; it is test code, not part of any package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_gguf import TinySpec, tiny_weights, write_gguf

# Tensors stored quantised in the tiny model, so the loader's dequantisation path is exercised too.
TINY_QUANT = {"blk.1.ffn_up.weight": "Q8_0", "blk.2.attn_q.weight": "Q4_1", "blk.3.attn_k.weight": "Q4_0"}


@pytest.fixture(scope="session")
def tiny_spec() -> TinySpec:
    return TinySpec()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_spec) -> Path:
    """A 5-block llama GGUF with a tied head and a few quantised tensors."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, tiny_spec, tiny_weights(tiny_spec, seed=1), quant=TINY_QUANT)
