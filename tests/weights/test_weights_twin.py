"""Weights through the swarm with whole daemons in one process (`swarmd.testing.twin`, virtual time): daemons
that join with no file (`--model manifest:HASH`, each its own model cache) fetch exactly the chunks of the stage
the plan gives them from the one that holds the file, and answer as a swarm of holders does."""

from __future__ import annotations

import pytest

from models.catalog.chunk_store import PartialModel
from swarmd.testing.twin import TwinDaemon
from tests.swarm.tiny_model import write_tiny_llama
from tests.twin_swarm import twin_swarm

pytestmark = pytest.mark.slow  # a few seconds each: tinygrad runs the tiny model's steps

PROMPT = [40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", n_blocks=6, vocab=300,
                            byte_tokenizer=True, scale=0.5)


def stage_chunks(d: TwinDaemon) -> set[int]:
    node = d.node
    assert node is not None and node.weights is not None and node.weights.parts is not None
    return set(node.weights.parts.assignment(node.assignment.loaded_layers, {}))


def held(d: TwinDaemon) -> set[int]:
    assert d.node is not None and d.node.weights is not None
    store = d.node.weights.store
    assert isinstance(store, PartialModel)
    return set(store.held())


def fetched_bytes(d: TwinDaemon) -> int:
    assert d.node is not None and d.node.weights is not None and d.node.weights.fetcher is not None
    return sum(d.node.weights.fetcher.bytes_from.values())


async def test_daemons_with_no_file_fetch_their_stage_only_and_answer_as_holders_do(nursery, tmp_path, model,
                                                                                    autojump_clock):
    holders_twin, holders = await twin_swarm(nursery, tmp_path / "holders", model, 3)
    expected = await holders_twin.generate(holders[0], PROMPT, max_tokens=12)
    assert not expected.error and len(expected.tokens) == 12

    digest = holders[0].node.model.digest
    no_file = {"model": f"manifest:{digest}"}
    twin, daemons = await twin_swarm(nursery, tmp_path / "fetchers", model, 3, per_daemon={1: no_file, 2: no_file})
    founder, joiners = daemons[0], daemons[1:]
    plan = founder.node.plan
    assert len(plan.stages) == 3  # every member has a stage
    everything = set(range(len(founder.node.weights.store.manifest.chunks)))
    for d in joiners:
        assert d.node.model.digest == digest and d.node.model.path.parent.parent == d.home / "partial-models"
        assert stage_chunks(d) <= held(d) < everything  # its stage's chunks, not the whole model
        assert fetched_bytes(d) > 0 and d.node.weights.progress.active is False
    assert held(joiners[-1]) == stage_chunks(joiners[-1])  # the last to join was planned once: nothing more
    assert await twin.generate(founder, PROMPT, max_tokens=12) == expected
    assert await twin.generate(joiners[0], PROMPT, max_tokens=12) == expected
