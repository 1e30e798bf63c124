"""The last stage's decision on a verify step (`acceptance.verify`): a pass yields exactly the tokens decoding one at
a time draws at its steps, greedy or sampled, whatever the drafts; so sampling keeps the target's distribution (a
chi-square test over many seeded draws) and every decision replays from (seed, step)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from models.sampling import SamplingParams, sample, sample_probs
from swarmd.inference.spec.acceptance import verify

GREEDY = SamplingParams()
WARM = SamplingParams(temperature=0.8)


@given(st.integers(0, 2**32), st.integers(0, 6), st.integers(0, 100))
def test_greedy_keeps_drafts_while_they_are_the_argmax_then_the_argmax(seed, k, step):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((k + 1, 5)).astype(np.float32)
    best = [int(np.argmax(row)) for row in logits]
    draft = [best[i] if rng.random() < 0.7 else int(rng.integers(5)) for i in range(k)]
    verdict = verify(logits, draft, GREEDY, seed=seed, step=step)
    m = next((i for i in range(k) if draft[i] != best[i]), k)
    assert verdict.accepted == m and list(verdict.tokens) == best[:m + 1]


@given(st.integers(0, 2**32), st.integers(0, 4))
def test_a_pass_decides_the_same_every_time_it_is_run(seed, k):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((k + 1, 7))
    draft = [int(t) for t in rng.integers(0, 7, k)]
    assert verify(logits, draft, WARM, seed=seed, step=3) == verify(logits, draft, WARM, seed=seed, step=3)


@given(st.integers(0, 2**32), st.integers(0, 6), st.integers(0, 100))
def test_a_sampled_pass_yields_the_tokens_plain_sampling_draws_at_its_steps_whatever_the_drafts(seed, k, step):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((k + 1, 5)) * 2
    plain = [sample(row, WARM, seed=seed, step=step + i) for i, row in enumerate(logits)]
    draft = [plain[i] if rng.random() < 0.7 else int(rng.integers(5)) for i in range(k)]
    verdict = verify(logits, draft, WARM, seed=seed, step=step)
    m = next((i for i in range(k) if draft[i] != plain[i]), k)
    assert verdict.accepted == m and list(verdict.tokens) == plain[:m + 1]


def test_without_drafts_the_token_is_the_one_plain_sampling_draws():
    logits = np.random.default_rng(0).standard_normal((1, 50))
    for seed in range(50):
        assert verify(logits, [], WARM, seed=seed, step=9).tokens == (sample(logits[0], WARM, seed=seed, step=9),)


def chi_square_bound(df: int, z: float = 3.72) -> float:
    """The chi-square quantile at about 1 - 1e-4 (Wilson-Hilferty), for df degrees of freedom."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_distributed_as(counts: np.ndarray, p: np.ndarray) -> None:
    """A chi-square goodness-of-fit test; categories expected fewer than 5 times are pooled."""
    n = counts.sum()
    expected = p * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert stat < chi_square_bound(int(keep.sum()) - 1), (stat, obs, exp)


def check_sampler(logits: np.ndarray, draft_logits: np.ndarray | None, draws: int = 20000) -> None:
    """Tokens of a 2-draft pass over many seeds: the first is distributed as the target's p0, the second (when the
    first draft was accepted) as p1; drafts deterministic (None) or drawn from the draft model's q. A fixed draft
    is accepted as often as the target draws it."""
    p = [sample_probs(row, WARM) for row in logits]
    qs = None if draft_logits is None else [sample_probs(row, WARM) for row in draft_logits]
    firsts = np.zeros(logits.shape[1], np.int64)
    seconds = np.zeros(logits.shape[1], np.int64)
    fixed = [int(np.argsort(-p[0])[1]), int(np.argmax(p[1]))]  # a plausible but not the likeliest first draft
    for seed in range(draws):
        if qs is None:
            draft = fixed
        else:
            rng = np.random.default_rng([seed, 99])
            draft = [int(rng.choice(q.size, p=q)) for q in qs]
        verdict = verify(logits, draft, WARM, seed=seed, step=4)
        firsts[verdict.tokens[0]] += 1
        if verdict.accepted >= 1 and draft[0] == (fixed[0] if qs is None else draft[0]):
            seconds[verdict.tokens[1]] += 1
    assert_distributed_as(firsts, p[0])
    if qs is None:  # row 1's logits were computed after the fixed first draft: its tokens follow p1
        assert abs(seconds.sum() / draws - p[0][fixed[0]]) < 4 * math.sqrt(p[0][fixed[0]] / draws)
        assert seconds.sum() > 1000
        assert_distributed_as(seconds, p[1])


def test_sampling_follows_the_target_with_deterministic_drafts():
    rng = np.random.default_rng(5)
    check_sampler(rng.standard_normal((3, 12)) * 2, None)


def test_sampling_follows_the_target_with_drafts_drawn_from_another_distribution():
    rng = np.random.default_rng(6)
    check_sampler(rng.standard_normal((3, 12)) * 2, rng.standard_normal((2, 12)) * 2)


@pytest.mark.slow  # compiles the tiny model's kernels
def test_at_temperature_0_8_a_tiny_models_speculative_tokens_follow_its_own_distribution(tmp_path):
    """The tiny model's logits for a context and a 2-token draft (a verify step's rows), and a second tiny model of
    the same vocabulary as the draft model: the speculative sampler's tokens follow the target's distribution."""
    from models.stage import SERVING_NUMERICS, StageInput, StageModel
    from tests.swarm.tiny_model import write_tiny_llama

    def logits_of(path, rows: list[int], context: list[int]) -> np.ndarray:
        model = StageModel.from_gguf(path, max_context=64, max_requests=1, numerics=SERVING_NUMERICS)
        model.add_request("r")
        model.forward([StageInput("r", 0, np.asarray(context, np.int32))])
        return model.forward([StageInput("r", len(context), np.asarray(rows, np.int32), verify=True)])[0]

    target = write_tiny_llama(tmp_path / "target.gguf", n_blocks=2, vocab=64, scale=0.3)
    drafter = write_tiny_llama(tmp_path / "draft.gguf", n_blocks=1, vocab=64, scale=0.3, seed=1)
    context = [5, 9, 12, 5, 9]
    first = logits_of(target, [12], context)[0]
    second_draft = int(np.argsort(-sample_probs(first, WARM))[1])
    logits = logits_of(target, [12, second_draft, 3], context)  # rows: last token, the two drafts
    check_sampler(logits, None)
    check_sampler(logits[:, :], logits_of(drafter, [12, second_draft], context), draws=10000)
