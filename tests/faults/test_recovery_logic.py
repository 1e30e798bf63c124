"""Moving a request to a new chain, without a network: what the head replays, how stages take it, and what a
stage forgets when a request's head is gone (sans-IO: `swarmd.recovery`, `StageBook`)."""

from __future__ import annotations

import numpy as np

from swarmd.recovery import Recovery, attempt_id, chain_changed, replay_forward
from swarmd.registry import Registry
from swarmd.stage_session import Sampled, StageBook
from swarmd.wire import Forward, Sampling, Token, WireTensor

HIDDEN, VOCAB = 8, 100
SAMPLING = Sampling(temperature=0.0, seed=5, max_tokens=10, stop_ids=(2,))


def registry(epoch: int, *stages: tuple[str, int, int]) -> Registry:
    return Registry(epoch, tuple(p for p, _, _ in stages), tuple((a, b) for _, a, b in stages), {})


def test_a_chain_changes_when_a_peer_or_a_block_range_changes_not_when_only_the_epoch_does():
    old = registry(1, ("A", 0, 15), ("B", 15, 30))
    assert not chain_changed(old, registry(2, ("A", 0, 15), ("B", 15, 30)))
    assert chain_changed(old, registry(2, ("A", 0, 30)))
    assert chain_changed(old, registry(2, ("A", 0, 10), ("B", 10, 30)))
    assert not chain_changed(old, Registry(0, (), (), {}))  # no plan yet: nothing to move to


def test_the_replay_carries_prompt_and_generated_tokens_from_position_0_at_the_next_step():
    msg = replay_forward("req-1", 2, "H", (5, 6, 7), [40, 41], SAMPLING, 9, prompt_scores=False)
    assert msg.request_id == attempt_id("req-1", 2) == "req-1.r2"
    assert (msg.step, msg.hop, msg.start_pos, msg.head, msg.epoch) == (2, 0, 0, "H", 9)
    assert list(msg.tokens.to_array()) == [5, 6, 7, 40, 41] and msg.sampling == SAMPLING
    msg.check()
    scored = replay_forward("req-1", 1, "H", (5, 6, 7), [40], SAMPLING, 9, prompt_scores=True)
    assert scored.step == 0 and scored.all_logits and list(scored.targets.to_array()) == [6, 7]


def test_every_stage_takes_a_replay_as_a_new_request_and_the_chain_goes_on_at_the_next_step():
    first, last = StageBook(0, 2, 64, VOCAB), StageBook(1, 2, 64, VOCAB)
    replay = replay_forward("req-1", 1, "H", (5, 6, 7), [40, 41], SAMPLING, 4, prompt_scores=False)
    work = first.on_forward(replay, now=1.0)
    assert work.new and (work.step, work.start_pos, work.rows) == (2, 0, 5)
    (out,) = first.complete(work, np.zeros((5, HIDDEN), np.float32), next_peer="S1", first_peer="S0", now=2.0)
    assert isinstance(out.msg, Forward) and out.msg.step == 2 and out.msg.sampling == SAMPLING  # the next stage's first
    work = last.on_forward(out.msg, now=2.0)
    assert work.new and work.sampling == SAMPLING
    outs = last.complete(work, Sampled(42), next_peer=None, first_peer="S0", now=3.0)
    assert [(o.msg.step, o.msg.hop) for o in outs] == [(2, 0), (2, 1)]  # token of step 2, numbered as undisturbed
    work = first.on_token(Token("req-1.r1", 2, 42), now=4.0)
    assert (work.step, work.start_pos, work.new) == (3, 5, False)


def test_a_stage_forgets_the_requests_of_a_dead_head_and_frees_them_once_the_model_is_done():
    book = StageBook(1, 2, 64, VOCAB)
    hidden = WireTensor.from_array(np.ones((2, HIDDEN), np.float32))
    idle = book.on_forward(Forward("a", 0, 1, 0, "DEAD", hidden=hidden, sampling=SAMPLING), now=1.0)
    book.complete(idle, Sampled(3), next_peer=None, first_peer="S0", now=1.5)
    book.on_forward(Forward("b", 0, 1, 0, "DEAD", hidden=hidden, sampling=SAMPLING), now=2.0)  # with the model
    book.on_forward(Forward("c", 0, 1, 0, "ALIVE", hidden=hidden, sampling=SAMPLING), now=2.0)
    assert book.drop_heads({"DEAD"}) == ["a"]  # free now; "b" when its step is done
    assert set(book.requests) == {"b", "c"} and book.requests["b"].cancelled


def test_a_recovery_reports_its_parts_in_seconds():
    r = Recovery("plan epoch 3 changed the chain", noticed=10.0, ready=12.5, sent=12.5, first_token=13.0)
    assert r.to_json()["wait_for_chain_s"] == 2.5 and r.to_json()["replay_s"] == 0.5
    assert r.to_json()["total_s"] == 3.0


def test_the_chain_status_names_the_peers_gone_so_heads_know_which_requests_to_move():
    from swarmd.registry import chain_status

    plan = {"epoch": 2, "stages": [{"peer_id": "A", "layers": [0, 15]}, {"peer_id": "B", "layers": [15, 30]}]}
    ready = {"state": "ready", "layers": [0, 15]}
    status = chain_status(plan, [{"peer_id": "A", "state": "alive", "assignment": ready},
                                 {"peer_id": "B", "state": "dead", "assignment": {"state": "ready", "layers": [15, 30]}}])
    assert not status.ready and status.gone == {"B"} and "gone" in status.detail
