"""Splitting a model into pipeline stages and chaining them gives the whole model's logits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tinygrad.llm.model import TransformerConfig

from models.stage import StageInput, StageModel

# compiles and runs tinygrad kernels (seconds each on a cold kernel cache)
pytestmark = pytest.mark.slow

CONFIG = TransformerConfig(num_blocks=5, dim=64, hidden_dim=128, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                           vocab_size=96, head_dim=16, rope_theta=10000.0, rope_dim=16, v_head_dim=16)
SPLITS = {2: [0, 3, 5], 3: [0, 1, 3, 5], 5: [0, 1, 2, 3, 4, 5]}
PROMPT = np.array([5, 17, 42, 8, 91, 23, 60])
# Stages run the same kernels on the same values as the whole model, up to reassociation of sums.
ATOL = 1e-4


def build(bounds: list[int]) -> list[StageModel]:
    return [StageModel.random(CONFIG, seed=7, start=a, end=b, max_context=32, max_requests=2, dtype="float32")
            for a, b in itertools.pairwise(bounds)]


def run_chain(stages: list[StageModel], rid: str, start: int, data: np.ndarray, all_logits: bool = False):
    for stage in stages:
        if not stage.has_request(rid):
            stage.add_request(rid)
        data = stage.forward([StageInput(rid, start, data, all_logits=all_logits and stage.is_last)])[0]
    return data


@pytest.fixture(scope="module")
def whole():
    return build([0, 5])[0]


def greedy(stages: list[StageModel], rid: str, n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    prefill = run_chain(stages, rid, 0, PROMPT, all_logits=True)
    steps, token = [], int(prefill[-1].argmax())
    for i in range(n):
        steps.append(run_chain(stages, rid, len(PROMPT) + i, np.array([token])))
        token = int(steps[-1].argmax())
    for stage in stages:
        stage.free_request(rid)
    return prefill, steps


@pytest.mark.parametrize("n_stages", sorted(SPLITS))
def test_chained_stages_give_the_whole_models_logits(whole, n_stages):
    stages = build(SPLITS[n_stages])
    assert [s.is_first for s in stages] == [True] + [False] * (n_stages - 1)
    assert [s.is_last for s in stages] == [False] * (n_stages - 1) + [True]
    want_prefill, want_steps = greedy([whole], f"w{n_stages}", 3)
    got_prefill, got_steps = greedy(stages, "s", 3)
    np.testing.assert_allclose(got_prefill, want_prefill, atol=ATOL, rtol=0)
    for got, want in zip(got_steps, want_steps, strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_inner_stages_pass_hidden_states_of_the_model_width():
    first, middle, last = build([0, 2, 4, 5])
    first.add_request("r"), middle.add_request("r"), last.add_request("r")
    hidden = first.forward([StageInput("r", 0, PROMPT)])[0]
    assert hidden.shape == (len(PROMPT), CONFIG.dim) and hidden.dtype == np.float32
    hidden = middle.forward([StageInput("r", 0, hidden)])[0]
    assert hidden.shape == (len(PROMPT), CONFIG.dim)
    assert last.forward([StageInput("r", 0, hidden)])[0].shape == (CONFIG.vocab_size,)
