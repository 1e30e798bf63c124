"""The simulation's models (written once per session) and the pool of loaded stages every seed shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmd.testing.twin import ModelPool
from tests.pipeline.conftest import kernel_cache_per_thread
from tests.simulation.runner import References

__all__ = ["kernel_cache_per_thread"]


@pytest.fixture(scope="session")
def sim_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A dense and a mixture-of-experts model, tiny, with byte-level tokenizers."""
    from models.catalog.moe_writer import SYNTHETIC_MOE, write_synthetic_moe
    from tests.swarm.tiny_model import write_tiny_llama

    root = tmp_path_factory.mktemp("sim-models")
    dense = write_tiny_llama(root / "dense.gguf", n_blocks=6, vocab=300, byte_tokenizer=True, scale=0.5)
    moe = write_synthetic_moe(root / "moe.gguf", SYNTHETIC_MOE["tiny"], 3, vocab=300, byte_tokenizer=True,
                              name="sim-moe")
    return {"dense": str(dense), "moe": str(moe)}


@pytest.fixture(scope="session")
def sim_pool() -> ModelPool:
    return ModelPool()


@pytest.fixture(scope="session")
def sim_references() -> References:
    return {}


@pytest.fixture(scope="session")
def sim_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sim")
