"""A moved request's stage that keeps its KV cache and computes only the positions it lacks gives what a full
prefill of the whole history gives (the hop-local rebuild, `swarmd.inference.head.hop_local`), on a seeded model in two
stages: the first takes token ids, the second the first's rows."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad.llm.model import TransformerConfig

from models.errors import ModelError
from models.stage import StageInput, StageModel

# compiles and runs tinygrad kernels (seconds on a cold kernel cache)
pytestmark = pytest.mark.slow

CONFIG = TransformerConfig(num_blocks=2, dim=64, hidden_dim=128, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                           vocab_size=96, head_dim=16, rope_theta=10000.0, rope_dim=16, v_head_dim=16)
PROMPT = [5, 17, 42, 8, 91, 23, 60, 2, 33]
DECODED = 4


@pytest.fixture(scope="module")
def stages() -> tuple[StageModel, StageModel]:
    return tuple(StageModel.random(CONFIG, seed=11, start=a, end=b, max_context=48, max_requests=3, dtype="float32")
                 for a, b in ((0, 1), (1, 2)))


def run(stages, rid: str, start: int, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One step of `rid` through both stages: the first stage's rows and the last position's logits."""
    first, last = stages
    rows = first.forward([StageInput(rid, start, np.array(tokens))])[0]
    logits = last.forward([StageInput(rid, start, rows)])[0]
    return rows, logits


@pytest.fixture(scope="module")
def undisturbed(stages):
    """Request "old": the prompt, then DECODED greedy steps; its history, the first stage's rows, its caches."""
    for s in stages:
        s.add_request("old")
    rows, logits = run(stages, "old", 0, PROMPT)
    kept, tokens = [rows], [int(logits.argmax())]
    for i in range(DECODED):
        rows, logits = run(stages, "old", len(PROMPT) + i, [tokens[-1]])
        kept.append(rows)
        tokens.append(int(logits.argmax()))
    return [*PROMPT, *tokens], np.concatenate(kept)


def full_prefill(stages, rid: str, history: list[int]) -> tuple[np.ndarray, np.ndarray]:
    for s in stages:
        s.add_request(rid)
    try:
        return run(stages, rid, 0, history)
    finally:
        for s in stages:
            s.free_request(rid)


@pytest.mark.parametrize("keep", [len(PROMPT) + DECODED - 1, 4])
def test_stages_that_adopt_the_old_cache_and_compute_the_rest_give_the_full_prefills_rows_and_logits(
        stages, undisturbed, keep):
    history, kept_rows = undisturbed  # the caches hold every position but the last token's
    first, last = stages
    rid = f"new-{keep}"
    want_rows, want_logits = full_prefill(stages, "full", history)
    for s in stages:
        s.adopt_request("old", rid, keep)
        assert s.position(rid) == keep and not s.has_request("old")
    rows = first.forward([StageInput(rid, keep, np.array(history[keep:]))])[0]
    np.testing.assert_allclose(np.concatenate([kept_rows[:keep], rows]), want_rows, rtol=1e-4, atol=1e-4)
    # the second stage, on the rows the first sent on (the kept ones and the new ones), computes its suffix
    logits = last.forward([StageInput(rid, keep, np.concatenate([kept_rows[:keep], rows])[keep:])])[0]
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert int(logits.argmax()) == int(want_logits.argmax())
    # hand the caches back for the other case (keep fewer than they hold, as after a second move)
    for s in stages:
        s.adopt_request(rid, "old", len(history))


def test_a_new_stage_built_from_the_previous_stages_kept_rows_gives_the_undisturbed_next_token(stages, undisturbed):
    history, kept_rows = undisturbed
    _, last = stages
    want = full_prefill(stages, "full2", history)[1]
    last.add_request("spare")
    rows = stages[0].forward([StageInput("old", len(history) - 1, np.array(history[-1:]))])[0]
    logits = last.forward([StageInput("spare", 0, np.concatenate([kept_rows[:len(history) - 1], rows]))])[0]
    last.free_request("spare")
    assert int(logits.argmax()) == int(want.argmax())
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)


def test_adopting_what_a_stage_does_not_hold_or_more_than_it_holds_is_refused(stages):
    first, _ = stages
    with pytest.raises(ModelError, match="nothing to adopt"):
        first.adopt_request("nobody", "x", 0)
    first.add_request("short")
    with pytest.raises(ModelError, match="cannot keep"):
        first.adopt_request("short", "x", 1)
    first.free_request("short")
