"""The last stage's part of a step: the model picks a greedy request's token itself (on its device) when the request
needs nothing but the token; otherwise the stage samples and scores from the logits."""

from __future__ import annotations

import numpy as np
import pytest

from swarmd.inference.stage.batch import picks_greedily, sample_step
from swarmd.inference.stage.book import Work
from swarmd.wire.codec import WireTensor
from swarmd.wire.messages import Draft, Sampling

LOGITS = np.array([0.5, 3.0, -1.0, 2.5], np.float32)
GREEDY = Sampling()


def work(sampling: Sampling | None = GREEDY, **changes) -> Work:
    return Work("r", 3, 7, np.array([1], np.int32), sampling=sampling, **changes)


def test_a_greedy_request_that_wants_only_its_token_is_picked_by_the_model():
    assert picks_greedily(work())


@pytest.mark.parametrize("why, step", [
    ("sampled", work(Sampling(temperature=0.7))),
    ("log-probs asked for", work(Sampling(logprobs=2))),
    ("a verify step", work(draft=Draft(WireTensor.from_array(np.array([2, 3], np.int32))))),
    ("prompt scores", work(all_logits=True)),
    ("no sampling: not the last stage", work(None)),
])
def test_any_other_step_gets_the_logits(why, step):
    assert not picks_greedily(step), why


def test_a_picked_token_is_the_steps_token_and_equals_the_pick_from_the_logits():
    picked = sample_step(np.asarray(np.argmax(LOGITS), np.int32), work())
    assert picked == sample_step(LOGITS, work()) and picked.token == 1 and picked.logprob is None
