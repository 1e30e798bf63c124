"""What a stage does with each message, without a model or a network (StageBook is sans-IO)."""

from __future__ import annotations

import numpy as np
import pytest

from swarmd.inference.stage.book import Sampled, StageBook, StageRefusal, finish_reason
from swarmd.wire import Error, Forward, Logprobs, Sampling, Token, WireTensor

HIDDEN, VOCAB = 8, 100
SAMPLING = Sampling(temperature=0.0, seed=5, max_tokens=4, stop_ids=(2,))


def prefill(hop: int, rows: int = 3, rid: str = "r", **kw) -> Forward:
    if hop == 0:
        return Forward(rid, 0, 0, 0, "H", tokens=WireTensor.from_array(np.arange(rows, dtype=np.int32) + 10),
                       sampling=SAMPLING, epoch=3, **kw)
    hidden = WireTensor.from_array(np.ones((rows, HIDDEN), np.float32))
    return Forward(rid, 0, hop, 0, "H", hidden=hidden, sampling=SAMPLING, epoch=3, **kw)


def decode(hop: int, step: int, pos: int, rid: str = "r") -> Forward:
    return Forward(rid, step, hop, pos, "H", hidden=WireTensor.from_array(np.ones((1, HIDDEN), np.float32)))


def book(hop: int, n: int = 3, **kw) -> StageBook:
    return StageBook(hop, n, max_context=kw.pop("max_context", 16), vocab_size=VOCAB, **kw)


def test_stage_0_embeds_the_prompt_and_sends_hidden_states_on_with_the_sampling_settings():
    b = book(0)
    work = b.on_forward(prefill(0), now=1.0)
    assert work.new and work.step == 0 and work.start_pos == 0 and list(work.data) == [10, 11, 12]
    (out,) = b.complete(work, np.zeros((3, HIDDEN), np.float32), next_peer="S1", first_peer="S0", now=2.0)
    assert out.peer == "S1" and isinstance(out.msg, Forward)
    assert (out.msg.hop, out.msg.step, out.msg.start_pos, out.msg.head, out.msg.epoch) == (1, 0, 0, "H", 3)
    assert out.msg.sampling == SAMPLING and out.msg.hidden.dtype == "float32" and out.msg.hidden.shape == (3, HIDDEN)
    assert b.requests["r"].position == 3


def test_stage_0_turns_each_token_into_the_next_step_without_resending_the_settings():
    b = book(0)
    b.complete(b.on_forward(prefill(0), 1.0), np.zeros((3, HIDDEN), np.float32), next_peer="S1", first_peer="S0",
               now=1.0)
    work = b.on_token(Token("r", 0, 42), now=2.0)
    assert (work.step, work.start_pos, list(work.data), work.new) == (1, 3, [42], False)
    (out,) = b.complete(work, np.zeros((1, HIDDEN), np.float32), next_peer="S1", first_peer="S0", now=3.0)
    assert out.msg.step == 1 and out.msg.start_pos == 3 and out.msg.sampling is None


def test_the_last_stage_sends_each_token_to_stage_0_and_to_the_head():
    b = book(2)
    work = b.on_forward(prefill(2), 1.0)
    assert work.sampling == SAMPLING
    outs = b.complete(work, Sampled(7, -0.5, ((7, -0.5), (9, -1.0))), next_peer=None, first_peer="S0", now=2.0)
    assert [(o.peer, o.msg.hop, o.msg.finish) for o in outs] == [("S0", 0, ""), ("H", 1, "")]
    assert outs[1].msg.top_ids == (7, 9) and outs[1].msg.logprob == -0.5


@pytest.mark.parametrize(("token", "step", "cache_len", "why"), [
    (2, 0, 3, "stop"),  # an end-of-generation token, even at the last allowed step
    (2, 3, 6, "stop"),
    (7, 3, 6, "length"),  # max_tokens 4: the fourth token is the last
    (7, 1, 16, "length"),  # the context (16) is full
    (7, 1, 4, ""),
])
def test_the_last_stage_ends_a_request_like_swarmd_run(token, step, cache_len, why):
    assert finish_reason(token, step, cache_len, SAMPLING, 16) == why


def test_a_final_token_goes_only_to_the_head():
    b = book(2)
    work = b.on_forward(prefill(2), 1.0)
    (out,) = b.complete(work, Sampled(2), next_peer=None, first_peer="S0", now=2.0)
    assert out.peer == "H" and out.msg.finish == "stop"


def test_teacher_forcing_scores_go_to_the_head_before_the_token():
    b = book(2)
    targets = WireTensor.from_array(np.array([11, 12], np.int32))
    work = b.on_forward(prefill(2, all_logits=True, targets=targets), 1.0)
    assert work.all_logits and list(work.targets) == [11, 12]
    scores = Sampled(5, prompt_logprobs=np.array([-1.0, -2.0], np.float32),
                     prompt_top_ids=np.array([[11], [3]], np.int32), prompt_top_logprobs=np.array([[-1.0], [-0.5]],
                                                                                                  np.float32))
    outs = b.complete(work, scores, next_peer=None, first_peer="S0", now=2.0)
    assert isinstance(outs[0].msg, Logprobs) and outs[0].peer == "H"
    assert outs[0].msg.top_ids.to_array().tolist() == [[11], [3]]


def test_targets_travel_down_the_chain_with_the_hidden_states():
    b = book(1)
    targets = WireTensor.from_array(np.array([11, 12], np.int32))
    work = b.on_forward(prefill(1, all_logits=True, targets=targets), 1.0)
    (out,) = b.complete(work, np.zeros((3, HIDDEN), np.float32), next_peer="S2", first_peer="S0", now=2.0)
    assert out.msg.all_logits and out.msg.targets == targets


def test_steps_must_follow_each_other_and_start_where_the_cache_ends():
    b = book(1)
    b.complete(b.on_forward(prefill(1), 1.0), np.zeros((3, HIDDEN), np.float32), next_peer="S2", first_peer="S0",
               now=1.0)
    with pytest.raises(StageRefusal) as e:
        b.on_forward(decode(1, 2, 3), 2.0)
    assert e.value.code == "out_of_order"
    with pytest.raises(StageRefusal) as e:
        b.on_forward(decode(1, 1, 5), 2.0)
    assert e.value.code == "bad_position"
    with pytest.raises(StageRefusal) as e:
        b.on_forward(prefill(1), 2.0)
    assert e.value.code == "duplicate_request"
    work = b.on_forward(decode(1, 1, 3), 2.0)
    with pytest.raises(StageRefusal) as e:  # the model still runs step 1
        b.on_forward(decode(1, 2, 4), 2.0)
    assert e.value.code == "out_of_order" and work.step == 1


def test_unknown_requests_and_full_contexts_are_refused():
    b = book(1, max_context=4)
    with pytest.raises(StageRefusal) as e:
        b.on_forward(decode(1, 1, 3, rid="ghost"), 1.0)
    assert e.value.code == "unknown_request"
    with pytest.raises(StageRefusal) as e:
        b.on_forward(prefill(1, rows=5), 1.0)
    assert e.value.code == "context_full" and "r" not in b.requests
    with pytest.raises(StageRefusal) as e:
        book(0).on_token(Token("r", 0, VOCAB), 1.0)
    assert e.value.code == "bad_token"


def test_a_step_sent_for_a_plan_older_than_the_stages_blocks_is_refused_so_that_the_head_moves_it():
    # the step's hidden state came from a chain cut for plan 3; this stage has held its blocks since plan 4 (it
    # restarted, or was re-planned, at the same hop): its first block need not be where that chain's stage 0 ended
    b = book(1, since_epoch=4)
    for check in (b.must_wait, lambda msg: b.on_forward(msg, 1.0)):
        with pytest.raises(StageRefusal) as e:
            check(prefill(1))
        assert e.value.code == "stale_plan" and "epoch 3" in str(e.value) and "since epoch 4" in str(e.value)
    assert not b.requests and not b.reserved
    assert book(1, since_epoch=3).on_forward(prefill(1), 1.0).new  # sent for the plan it holds its blocks under


def test_a_cancel_frees_at_once_unless_the_model_is_running_the_request():
    b = book(1)
    idle = b.on_forward(prefill(1, rid="idle"), 1.0)
    b.complete(idle, np.zeros((3, HIDDEN), np.float32), next_peer="S2", first_peer="S0", now=1.0)
    busy = b.on_forward(prefill(1, rid="busy"), 1.0)
    assert b.cancel("idle") and "idle" not in b.requests
    assert not b.cancel("busy") and not b.cancel("never-seen")
    assert b.complete(busy, np.zeros((3, HIDDEN), np.float32), next_peer="S2", first_peer="S0", now=2.0) == []
    assert "busy" not in b.requests  # freed once the model was done with it


def test_a_failed_step_ends_the_request_and_tells_its_head():
    b = book(1)
    work = b.on_forward(prefill(1), 1.0)
    out = b.fail(work, "kv_cache_full", "all 4 KV cache slots are in use")
    assert out.peer == "H" and isinstance(out.msg, Error) and out.msg.code == "kv_cache_full"
    assert "r" not in b.requests and b.fail(work, "x", "y") is None


def test_idle_requests_expire():
    b = book(1)
    b.complete(b.on_forward(prefill(1, rid="old"), 1.0), np.zeros((3, HIDDEN), np.float32), next_peer="S2",
               first_peer="S0", now=1.0)
    b.on_forward(prefill(1, rid="running"), 1.0)  # busy requests never expire under the model
    assert b.expire(now=100.0, idle=60.0) == ["old"] and list(b.requests) == ["running"]


def test_a_lossy_wire_dtype_halves_the_bytes_but_never_overflows():
    b = book(0, wire_dtype="float16")
    work = b.on_forward(prefill(0), 1.0)
    (out,) = b.complete(work, np.ones((3, HIDDEN), np.float32), next_peer="S1", first_peer="S0", now=2.0)
    assert out.msg.hidden.dtype == "float16"
    work = b.on_token(Token("r", 0, 5), 3.0)
    (out,) = b.complete(work, np.full((1, HIDDEN), 1e6, np.float32), next_peer="S1", first_peer="S0", now=4.0)
    assert out.msg.hidden.dtype == "float32"  # 1e6 does not fit float16: sent losslessly instead


def test_the_next_plain_decode_step_is_begun_from_its_fields_alone_and_nothing_else_is():
    b = book(1, max_context=6, since_epoch=3)
    b.complete(b.on_forward(prefill(1), 1.0), np.zeros((3, HIDDEN), np.float32), next_peer="S2", first_peer="S0",
               now=1.0)
    row = np.ones((1, HIDDEN), np.float32)
    state = b.requests["r"]
    for refused in (("ghost", 1, 3, 3), ("r", 2, 3, 3), ("r", 1, 4, 3), ("r", 1, 3, 2)):  # (rid, step, pos, epoch)
        assert b.next_decode(*refused, row, 2.0) is None and state.phase.value == "waiting" and state.step == 0
    assert book(0).next_decode("r", 1, 3, 3, row, 2.0) is None  # stage 0 takes tokens
    work = b.next_decode("r", 1, 3, 3, row, 2.0)
    assert work is not None and (work.step, work.start_pos, work.new, work.sampling) == (1, 3, False, None)
    assert b.next_decode("r", 2, 4, 3, row, 2.0) is None  # the model still runs step 1
    b.complete(work, np.zeros((1, HIDDEN), np.float32), next_peer="S2", first_peer="S0", now=3.0)
    b.complete(b.next_decode("r", 2, 4, 3, row, 3.0), np.zeros((1, HIDDEN), np.float32), next_peer="S2",
               first_peer="S0", now=4.0)
    assert b.requests["r"].position == 5 and b.next_decode("r", 3, 5, 3, row, 4.0) is not None  # the last position
    first = book(0, max_context=6)
    first.complete(first.on_forward(prefill(0), 1.0), np.zeros((3, HIDDEN), np.float32), next_peer="S1",
                   first_peer="S0", now=1.0)
    assert first.next_decode("r", 1, None, None, np.array([VOCAB], np.int32), 2.0) is None  # outside the vocabulary
    assert list(first.next_decode("r", 1, None, None, np.array([42], np.int32), 2.0).data) == [42]
    speculative = book(1)
    start = Forward("r", 0, 1, 0, "H", hidden=WireTensor.from_array(np.ones((3, HIDDEN), np.float32)),
                    sampling=Sampling(speculative=True), epoch=3)
    speculative.complete(speculative.on_forward(start, 1.0), np.zeros((3, HIDDEN), np.float32), next_peer="S2",
                         first_peer="S0", now=1.0)
    assert speculative.next_decode("r", 1, 3, 3, row, 2.0) is None  # (its steps may start before the cache's end)


def test_a_step_completed_before_its_outputs_are_built_gives_what_complete_gives():
    whole, split = book(1, since_epoch=3), book(1, since_epoch=3)
    row = np.ones((1, HIDDEN), np.float32)
    for b in (whole, split):
        b.complete(b.on_forward(prefill(1), 1.0), np.zeros((3, HIDDEN), np.float32), next_peer="S2",
                   first_peer="S0", now=1.0)
    output = np.full((1, HIDDEN), 0.5, np.float32)
    (expected,) = whole.complete(whole.next_decode("r", 1, 3, 3, row, 2.0), output, next_peer="S2", first_peer="S0",
                                 now=2.0)
    work = split.next_decode("r", 1, 3, 3, row, 2.0)
    assert split.completed(work, output, 2.0)
    assert split.next_decode("r", 2, 4, 3, row, 2.0) is not None  # the next step may begin before the outputs
    (out,) = split.outputs(work, output, next_peer="S2", first_peer="S0")
    assert out == expected and split.requests["r"].position == whole.requests["r"].position
    cancelled = book(1, since_epoch=3)
    cancelled.complete(cancelled.on_forward(prefill(1), 1.0), np.zeros((3, HIDDEN), np.float32), next_peer="S2",
                       first_peer="S0", now=1.0)
    work = cancelled.next_decode("r", 1, 3, 3, row, 2.0)
    cancelled.cancel("r")
    assert not cancelled.completed(work, output, 2.0) and "r" not in cancelled.requests  # gone while it ran
