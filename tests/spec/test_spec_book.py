"""A stage's book of a speculative request (sans-IO): verify steps of several rows, rolled back past rejected drafts,
and the last stage answering the head (which drafts the next step) instead of stage 0."""

from __future__ import annotations

import numpy as np
import pytest

from swarmd.inference.stage.book import Sampled, StageBook, StageRefusal
from swarmd.wire import Draft, Forward, Sampling, Token, Verified, WireTensor

HIDDEN, VOCAB = 8, 100
SPEC = Sampling(temperature=0.0, seed=5, max_tokens=10, stop_ids=(2,), speculative=True)


def ids(*values: int) -> WireTensor:
    return WireTensor.from_array(np.asarray(values, np.int32))


def prefill(hop: int, rows: int = 3, sampling: Sampling = SPEC) -> Forward:
    if hop == 0:
        return Forward("r", 0, 0, 0, "H", tokens=WireTensor.from_array(np.arange(rows, dtype=np.int32) + 10),
                       sampling=sampling)
    return Forward("r", 0, hop, 0, "H", hidden=WireTensor.from_array(np.ones((rows, HIDDEN), np.float32)),
                   sampling=sampling)


def verify_step(hop: int, step: int, pos: int, last: int, *drafts: int) -> Forward:
    draft = Draft(ids(*drafts)) if drafts else None
    if hop == 0:
        return Forward("r", step, 0, pos, "H", tokens=ids(last, *drafts), draft=draft)
    rows = WireTensor.from_array(np.ones((1 + len(drafts), HIDDEN), np.float32))
    return Forward("r", step, hop, pos, "H", hidden=rows, draft=draft)


def book(hop: int, n: int = 3) -> StageBook:
    return StageBook(hop, n, max_context=16, vocab_size=VOCAB)


def run(b: StageBook, msg: Forward, output, now: float = 1.0):
    work = b.on_forward(msg, now)
    return work, b.complete(work, output, next_peer="S1", first_peer="S0", now=now)


def test_the_last_stage_answers_a_speculative_request_to_its_head_alone():
    b = book(2)
    _, outs = run(b, prefill(2), Sampled(7))
    assert [(o.peer, type(o.msg)) for o in outs] == [("H", Verified)]
    assert outs[0].msg == Verified("r", 0, (7,), drafted=0)


def test_a_verify_step_carries_its_draft_down_the_chain_and_rolls_back_what_the_last_rejected():
    b = book(0)
    run(b, prefill(0), np.zeros((3, HIDDEN), np.float32))
    work, (out,) = run(b, verify_step(0, 1, 3, 7, 8, 9, 4), np.zeros((4, HIDDEN), np.float32))
    assert work.verify and work.rollback is None and list(work.data) == [7, 8, 9, 4]
    assert out.msg.draft == Draft(ids(8, 9, 4)) and out.msg.start_pos == 3 and out.msg.rows == 4
    assert b.requests["r"].position == 7 and b.requests["r"].floor == 4
    # one draft accepted: the next step is step 3, from position 5 (after 7 and 8); positions 5 and 6 roll back
    work, _ = run(b, verify_step(0, 3, 5, 11, 12), np.zeros((2, HIDDEN), np.float32))
    assert (work.step, work.start_pos, work.rollback) == (3, 5, 5)
    assert b.requests["r"].position == 7 and b.requests["r"].floor == 6


def test_a_step_may_not_start_before_what_the_last_pass_accepted_or_repeat_a_step():
    b = book(0)
    run(b, prefill(0), np.zeros((3, HIDDEN), np.float32))
    run(b, verify_step(0, 1, 3, 7, 8, 9), np.zeros((3, HIDDEN), np.float32))
    with pytest.raises(StageRefusal) as e:
        b.on_forward(verify_step(0, 2, 3, 7, 8), 2.0)  # position 3 holds the accepted token 7
    assert e.value.code == "bad_position"
    with pytest.raises(StageRefusal) as e:
        b.on_forward(verify_step(0, 1, 4, 8, 9), 2.0)
    assert e.value.code == "out_of_order"


def test_a_draft_for_a_request_started_without_speculation_is_refused():
    b = book(0)
    run(b, prefill(0, sampling=Sampling(seed=5, max_tokens=10)), np.zeros((3, HIDDEN), np.float32))
    with pytest.raises(StageRefusal) as e:
        b.on_forward(verify_step(0, 1, 3, 7, 8), 2.0)
    assert e.value.code == "bad_draft"


def test_the_last_stage_sends_the_accepted_tokens_up_to_the_one_that_ends_the_request():
    b = book(2)
    run(b, prefill(2), Sampled(7))
    _, (out,) = run(b, verify_step(2, 1, 3, 7, 8, 2, 5), Sampled(5, tokens=(8, 2, 5)))
    assert out.msg == Verified("r", 1, (8, 2), drafted=3, finish="stop")  # 2 is an end-of-generation token


def test_max_tokens_cuts_a_pass_short():
    b = book(2)
    run(b, prefill(2, rows=10), Sampled(7))
    _, (out,) = run(b, verify_step(2, 8, 10, 7, 8, 9, 4), Sampled(3, tokens=(8, 9, 4, 3)))
    assert out.msg.tokens == (8, 9) and out.msg.finish == "length"  # steps 8 and 9 of at most 10


def test_the_head_hands_the_loop_to_the_chain_and_takes_it_back():
    b = book(2)
    run(b, prefill(2), Sampled(7))
    handback = Forward("r", 1, 2, 3, "H", hidden=WireTensor.from_array(np.ones((1, HIDDEN), np.float32)), chain=True)
    _, outs = run(b, handback, Sampled(8))
    assert [(o.peer, type(o.msg).__name__, o.msg.hop) for o in outs] == [("S0", "Token", 0), ("H", "Token", 1)]
    assert b.drive("r") and not b.drive("nobody")
    step2 = Forward("r", 2, 2, 4, "H", hidden=WireTensor.from_array(np.ones((1, HIDDEN), np.float32)))
    _, outs = run(b, step2, Sampled(9))
    assert [(o.peer, o.msg) for o in outs] == [("H", Verified("r", 2, (9,)))]


def test_stage_0_runs_the_chains_tokens_of_a_speculative_request_after_a_verify_step():
    b = book(0)
    run(b, prefill(0), np.zeros((3, HIDDEN), np.float32))
    run(b, verify_step(0, 1, 3, 7, 8, 9), np.zeros((3, HIDDEN), np.float32))
    handback = Forward("r", 2, 0, 5, "H", tokens=ids(8), chain=True)  # one draft accepted; 9 rolled back
    work, (out,) = run(b, handback, np.zeros((1, HIDDEN), np.float32))
    assert work.rollback == 5 and out.msg.chain
    work = b.on_token(Token("r", 2, 40), now=3.0)
    assert (work.step, work.start_pos, list(work.data)) == (3, 6, [40])
