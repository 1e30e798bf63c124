"""Sampling: greedy is argmax, draws are reproducible per (seed, step), filters keep what they promise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from models.sampling import SamplingParams, sample, sample_probs, token_logprob, top_logprobs

logits_arrays = arrays(np.float32, st.integers(2, 64),
                       elements=st.floats(-30, 30, width=32, allow_nan=False, allow_infinity=False))
params_st = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
                      top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]), top_k=st.sampled_from([0, 1, 3, 40]))
seeds = st.integers(0, 2**63 - 1)
steps = st.integers(0, 10_000)


@settings(max_examples=200, deadline=None)
@given(logits=logits_arrays, seed=seeds, step=steps)
def test_temperature_zero_is_argmax_whatever_the_seed(logits, seed, step):
    assert sample(logits, SamplingParams(temperature=0.0), seed=seed, step=step) == int(np.argmax(logits))


@settings(max_examples=200, deadline=None)
@given(logits=logits_arrays, params=params_st, seed=seeds, step=steps)
def test_a_retried_step_draws_the_same_token(logits, params, seed, step):
    first = sample(logits, params, seed=seed, step=step)
    assert sample(logits.copy(), params, seed=seed, step=step) == first


@settings(max_examples=200, deadline=None)
@given(logits=logits_arrays, params=params_st, seed=seeds, step=steps)
def test_the_drawn_token_has_nonzero_probability(logits, params, seed, step):
    token = sample(logits, params, seed=seed, step=step)
    assert sample_probs(logits, params)[token] > 0


@settings(max_examples=200, deadline=None)
@given(logits=logits_arrays, k=st.integers(1, 70), temperature=st.sampled_from([0.5, 1.0]))
def test_top_k_keeps_only_the_most_likely(logits, k, temperature):
    probs = sample_probs(logits, SamplingParams(temperature=temperature, top_k=k))
    kept = probs > 0
    assert math.isclose(probs.sum(), 1.0)
    assert logits[kept].min() >= logits[~kept].max(initial=-np.inf)
    assert kept.sum() >= min(k, logits.size)
    assert kept.sum() <= min(k, logits.size) or len(np.unique(logits[kept])) < kept.sum()  # only ties go past k


@settings(max_examples=200, deadline=None)
@given(logits=logits_arrays, top_p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(logits, top_p):
    full = sample_probs(logits, SamplingParams(temperature=1.0))
    probs = sample_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    kept = probs > 0
    assert full[kept].sum() >= top_p - 1e-9 or kept.all()
    smallest_kept = full[kept].min()
    assert full[kept].sum() - smallest_kept < top_p + 1e-9  # dropping any kept token falls below p
    assert full[~kept].max(initial=0.0) <= smallest_kept


def test_different_steps_and_seeds_give_varied_tokens_with_the_right_frequencies():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    params = SamplingParams(temperature=1.0)
    draws = np.array([sample(logits, params, seed=7, step=s) for s in range(4000)])
    freq = np.bincount(draws, minlength=3) / draws.size
    assert np.allclose(freq, [0.5, 0.3, 0.2], atol=0.03)
    other_seed = [sample(logits, params, seed=8, step=s) for s in range(50)]
    assert other_seed != list(draws[:50])


def test_top_logprobs_lists_the_best_tokens_in_order():
    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0], dtype=np.float32)
    top = top_logprobs(logits, 3)
    assert [i for i, _ in top] == [1, 3, 2]
    total = math.log(sum(math.exp(x) for x in logits))
    assert top[0][1] == pytest.approx(3.0 - total)
    assert token_logprob(logits, 4) == pytest.approx(-1.0 - total)
    assert top_logprobs(logits, 0) == [] and len(top_logprobs(logits, 99)) == 5


def test_a_nan_logit_counts_as_minus_infinity_in_the_pick_and_the_log_probs():
    logits = np.array([1.0, np.nan, 3.0, 2.0], np.float32)
    assert sample(logits, SamplingParams(), seed=0, step=0) == 2
    assert [i for i, _ in top_logprobs(logits, 4)] == [2, 3, 0, 1]
    assert token_logprob(logits, 1) == -np.inf and np.isfinite(token_logprob(logits, 2))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(max_tokens=0), dict(stop=("",))])
def test_invalid_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
