"""A stage keeps one KV cache per request: requests interleave, batch at different positions, retry."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
from tinygrad.llm.model import TransformerConfig

from models.errors import ModelError
from models.kv_cache import KVCacheFull
from models.stage import StageInput, StageModel

# compiles and runs tinygrad kernels (seconds each on a cold kernel cache)
pytestmark = pytest.mark.slow

CONFIG = TransformerConfig(num_blocks=2, dim=64, hidden_dim=128, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                           vocab_size=96, head_dim=16, rope_theta=10000.0, rope_dim=16, v_head_dim=16)
PROMPTS = {"a": [5, 17, 42, 8, 91, 23], "b": [60, 2, 33], "c": [11, 12, 13, 14, 15, 16, 17, 18, 19]}
STEPS = 5


@pytest.fixture(scope="module")
def model():
    return StageModel.random(CONFIG, seed=3, max_context=48, max_requests=4, dtype="float32")


def step(model: StageModel, rid: str, pos: int, tokens) -> np.ndarray:
    return model.forward([StageInput(rid, pos, np.array(tokens))])[0]


def alone(model: StageModel, rid: str) -> list[int]:
    """Greedy tokens of one request run by itself (prefill, then one decode step at a time)."""
    model.add_request(rid)
    prompt = PROMPTS[rid[0]]
    out = [int(step(model, rid, 0, prompt).argmax())]
    for i in range(STEPS - 1):
        out.append(int(step(model, rid, len(prompt) + i, [out[-1]]).argmax()))
    model.free_request(rid)
    return out


@pytest.fixture(scope="module")
def expected(model):
    return {k: alone(model, k + "0") for k in PROMPTS}


def test_interleaved_requests_give_the_tokens_each_gives_alone(model, expected):
    tokens = {k: [] for k in "ab"}
    for k in "ab":
        model.add_request(k)
    for k in "ab":
        tokens[k].append(int(step(model, k, 0, PROMPTS[k]).argmax()))
    for i in range(STEPS - 1):
        for k in "ab":
            tokens[k].append(int(step(model, k, len(PROMPTS[k]) + i, [tokens[k][-1]]).argmax()))
    for k in "ab":
        model.free_request(k)
        assert tokens[k] == expected[k]


def test_requests_at_different_positions_decode_as_one_batch(model, expected):
    tokens = {k: [] for k in "abc"}
    for k in "abc":
        model.add_request(k)
        tokens[k].append(int(step(model, k, 0, PROMPTS[k]).argmax()))
    for i in range(STEPS - 1):
        items = [StageInput(k, len(PROMPTS[k]) + i, np.array([tokens[k][-1]])) for k in "abc"]
        for k, logits in zip("abc", model.forward(items), strict=True):
            tokens[k].append(int(logits.argmax()))
    for k in "abc":
        model.free_request(k)
        assert tokens[k] == expected[k]


def test_greedy_items_get_their_tokens_picked_by_the_stage_beside_items_that_get_logits(model, expected):
    tokens = {k: [] for k in "abc"}
    for k in "abc":
        model.add_request(k)
        first = model.forward([StageInput(k, 0, np.array(PROMPTS[k]), greedy=k != "b")])[0]
        tokens[k].append(int(first) if k != "b" else int(first.argmax()))
    for i in range(STEPS - 1):
        items = [StageInput(k, len(PROMPTS[k]) + i, np.array([tokens[k][-1]]), greedy=k != "b") for k in "abc"]
        picked, logits = model.forward(items), model.forward([replace(it, greedy=False) for it in items])
        for k, pick, row in zip("abc", picked, logits, strict=True):
            assert (pick.shape, pick.dtype) == (((), np.int32) if k != "b" else ((96,), np.float32))
            assert int(pick if k != "b" else pick.argmax()) == int(row.argmax())
            tokens[k].append(int(row.argmax()))
    for k in "abc":
        model.free_request(k)
        assert tokens[k] == expected[k]


def test_prefill_and_decode_items_mix_in_one_call(model, expected):
    model.add_request("a"), model.add_request("b")
    first_a = int(step(model, "a", 0, PROMPTS["a"]).argmax())
    out = model.forward([StageInput("a", len(PROMPTS["a"]), np.array([first_a])), StageInput("b", 0, np.array(PROMPTS["b"]))])
    assert [first_a, int(out[0].argmax())] == expected["a"][:2]
    assert int(out[1].argmax()) == expected["b"][0]
    model.free_request("a"), model.free_request("b")


def test_a_retried_step_overwrites_instead_of_appending(model):
    model.add_request("r")
    step(model, "r", 0, PROMPTS["a"])
    once = step(model, "r", 6, [7])
    again = step(model, "r", 6, [7])
    assert model.position("r") == 7
    np.testing.assert_array_equal(once, again)
    # rewinding to an earlier position forgets what came after it
    step(model, "r", 3, [1, 2])
    assert model.position("r") == 5
    model.free_request("r")


def test_slots_run_out_then_free_up(model):
    ids = [f"s{i}" for i in range(model.max_requests)]
    for rid in ids:
        model.add_request(rid)
    with pytest.raises(KVCacheFull):
        model.add_request("one-too-many")
    model.free_request(ids[0])
    model.free_request(ids[0])  # idempotent
    assert not model.has_request(ids[0])
    model.add_request("one-too-many")
    assert model.position("one-too-many") == 0
    for rid in [*ids[1:], "one-too-many"]:
        model.free_request(rid)


@pytest.mark.parametrize("item, message", [
    (StageInput("x", 1, np.array([1])), "past its cache"),
    (StageInput("x", 0, np.array([], dtype=np.int64)), "empty input"),
    (StageInput("x", 0, np.zeros((2, 64), np.float32)), "input shape"),
    (StageInput("x", 0, np.arange(49)), "exceed the context"),
    (StageInput("nobody", 0, np.array([1])), "unknown request"),
    (StageInput("x", 0, np.array([3, 96])), "token ids must be"),
    (StageInput("x", 0, np.array([0.5, 1.0])), "token ids must be"),
    (StageInput("x", 0, np.array([3, 4]), all_logits=True, greedy=True), "greedy is only"),
])
def test_bad_items_are_refused_before_any_compute(model, item, message):
    model.add_request("x")
    with pytest.raises(ModelError, match=message):
        model.forward([item])
    assert model.position("x") == 0
    model.free_request("x")


def test_forward_runs_from_a_worker_thread(model, expected):
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.extend(alone(model, "a1")))
    worker.start()
    worker.join()
    assert result == expected["a"]


def test_warmup_captures_every_graph_and_leaves_no_request(model, expected):
    model.warmup()
    assert len(model.slots) == 0
    # a GPU stage also captures its slot-ordered attention's graphs (a span per batch size)
    assert {batch for batch, _segment, _span in model._decode_jits} == {1, 2, 4}
    assert all(jit.captured is not None for jit in model._decode_jits.values())
    assert alone(model, "b2") == expected["b"]
