"""Messages: every type survives the wire; unknown tags, versions and fields, bad values and tensors that do
not match what the receiver expects are refused with a code the sender can act on."""

from __future__ import annotations

import cbor2
import numpy as np
import pytest

from swarmd.errors import LocalProtocolError
from swarmd.wire import (
    Error,
    ExpertBatch,
    Forward,
    Token,
    WireError,
    WireTensor,
    decode,
    encode,
)
from swarmd.wire.expect import ExpectExpertBatch, ExpectForward, ExpectToken
from swarmd.wire.messages import ACTOR_MESSAGES, REGISTRY
from tests.wire.wire_examples import EXAMPLES, HIDDEN, body_of, f32, hidden, ids


def raw(tag, body, v=1, seq=1):
    return cbor2.dumps({"t": tag, "v": v, "seq": seq, "body": body})


def test_examples_cover_every_message_type():
    assert {type(m) for m in EXAMPLES} >= set(REGISTRY.values()) - {REGISTRY["pong"]}


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_with_its_sequence_number(msg):
    env = decode(body_of(msg, seq=99))
    assert env.seq == 99
    assert env.msg == msg


def test_actor_messages_have_keys_for_deduplication_and_control_does_not():
    for msg in EXAMPLES:
        if type(msg) in ACTOR_MESSAGES and not isinstance(msg, Error):
            key = msg.key()
            assert key[0] == msg.TAG
        if msg.CONTROL:
            assert msg.key() is None
    assert EXAMPLES[0].key() == ("forward", "req-1", 0, 0)


def test_sending_an_invalid_message_is_our_own_error():
    with pytest.raises(LocalProtocolError):
        encode(Forward("r", 0, 0, 0, "h", tokens=ids(1), hidden=hidden()))  # both payloads
    with pytest.raises(LocalProtocolError, match="NaN"):
        encode(Token("r", 0, 1, logprob=float("nan")))


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (cbor2.dumps([1, 2]), "bad_envelope"),
        (cbor2.dumps({"t": "ack", "v": 1, "seq": 1}), "bad_envelope"),
        (raw("forward", {}, seq=-1), "bad_envelope"),
        (raw("teleport", {}), "unknown_type"),
        (raw(7, {}), "unknown_type"),
        (raw("ack", {}, v=2), "bad_version"),
        (raw("ack", {}, v=True), "bad_version"),
        (raw("ack", {"extra": 1}), "unknown_field"),
        (raw("cancel", {}), "missing_field"),
        (raw("cancel", {"request_id": 5}), "bad_field"),
        (raw("cancel", {"request_id": ""}), "bad_field"),
        (raw("cancel", {"request_id": "x" * 2000}), "bad_field"),
        (raw("token", {"request_id": "r", "step": True, "token": 1}), "bad_field"),
        (raw("token", {"request_id": "r", "step": 1, "token": -1}), "bad_field"),
        (raw("token", {"request_id": "r", "step": 1, "token": 1, "top_ids": [1], "top_logprobs": []}), "bad_field"),
        (raw("token", {"request_id": "r", "step": 1, "token": 1 << 64}), "not_cbor"),
        (raw("token", {"request_id": "r", "step": 1, "token": 1, "top_ids": [1], "top_logprobs": [float("nan")]}),
         "bad_field"),
        (raw("verified", {"request_id": "r", "step": 1, "tokens": [1], "logprobs": [float("nan")]}), "bad_field"),
    ],
)
def test_malformed_frames_are_refused_with_a_code(frame, code):
    with pytest.raises(WireError) as info:
        decode(frame)
    assert info.value.code == code


def forward_body(**changes):
    msg = Forward("req-7", 1, 1, 3, "head", hidden=hidden())
    body = cbor2.loads(body_of(msg))["body"]
    body.update(changes)
    return raw("forward", body, seq=12)


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"hidden": {"dtype": "float32", "shape": [1, HIDDEN], "data": b"\0" * 3}}, "bad_tensor"),
        ({"hidden": {"dtype": "int32", "shape": [1, HIDDEN], "data": b"\0" * 4 * HIDDEN}}, "bad_dtype"),
        ({"hidden": {"dtype": "float32", "shape": [HIDDEN], "data": b"\0" * 4 * HIDDEN}}, "bad_shape"),
        ({"tokens": ids(1).to_cbor()}, "bad_field"),  # both payloads
        ({"sampling": {"temperature": -1.0}}, "bad_field"),
        ({"sampling": {"top_p": float("nan")}}, "bad_field"),
        ({"sampling": {"warp": 9}}, "unknown_field"),
        ({"resume_of": "req-6"}, "bad_field"),  # a resume is a first step: with sampling, from position 0
        ({"resume_of": 6}, "bad_field"),
    ],
)
def test_a_refusal_names_the_frame_and_request_it_concerns(changes, code):
    with pytest.raises(WireError) as info:
        decode(forward_body(**changes))
    assert info.value.code == code
    assert info.value.seq == 12
    assert info.value.request_id == "req-7"


STAGE_1 = ExpectForward(hop=1, hidden_size=HIDDEN, vocab_size=49152, max_rows=64)


@pytest.mark.parametrize(
    ("msg", "code"),
    [
        (Forward("r", 0, 1, 0, "h", hidden=hidden(width=HIDDEN + 1)), "bad_shape"),
        (Forward("r", 0, 1, 0, "h", hidden=hidden(wire_dtype="float16")), "bad_dtype"),
        (Forward("r", 0, 1, 0, "h", hidden=hidden(rows=65)), "bad_shape"),
        (Forward("r", 0, 1, 0, "h", tokens=ids(5)), "bad_shape"),
        (Forward("r", 0, 2, 0, "h", hidden=hidden()), "wrong_hop"),
        (Forward("r", 0, 1, (1 << 20) - 1, "h", hidden=hidden(2)), "bad_shape"),
    ],
)
def test_stage_expectations_refuse_what_the_plan_does_not_allow(msg, code):
    with pytest.raises(WireError) as info:
        STAGE_1(msg)
    assert info.value.code == code


def test_stage_expectations_accept_a_configured_wire_dtype():
    ExpectForward(hop=1, hidden_size=HIDDEN, vocab_size=10, dtypes=frozenset({"float32", "float16"}))(
        Forward("r", 0, 1, 0, "h", hidden=hidden(wire_dtype="float16"))
    )


def test_stage_zero_takes_only_token_ids_inside_the_vocabulary():
    stage0 = ExpectForward(hop=0, hidden_size=HIDDEN, vocab_size=100)
    stage0(Forward("r", 0, 0, 0, "h", tokens=ids(0, 99)))
    with pytest.raises(WireError, match="vocabulary"):
        stage0(Forward("r", 0, 0, 0, "h", tokens=ids(0, 100)))
    with pytest.raises(WireError, match="takes token ids"):
        stage0(Forward("r", 0, 0, 0, "h", hidden=hidden()))
    with pytest.raises(WireError, match="vocabulary"):
        ExpectToken(vocab_size=100)(Token("r", 0, 100))


def test_expert_expectations_check_width_slots_and_expert_ids():
    expect = ExpectExpertBatch(hidden_size=HIDDEN, n_experts=8, max_slots=2)
    good = ExpertBatch("b", 0, 1, hidden(2), WireTensor.from_array(np.array([[0, -1], [7, 3]], np.int32)), f32(2, 2))
    expect(good)
    bad_ids = WireTensor.from_array(np.array([[0, 8], [1, 2]], np.int32))
    with pytest.raises(WireError, match="expert ids"):
        expect(ExpertBatch("b", 0, 1, hidden(2), bad_ids, f32(2, 2)))
    three = WireTensor.from_array(np.zeros((2, 3), np.int32))
    with pytest.raises(WireError, match="slots"):
        expect(ExpertBatch("b", 0, 1, hidden(2), three, f32(2, 3)))


@pytest.mark.parametrize(("traced", "steps"), [(("r",), ()), (("r", "s", "t"), (1, 2, 3)), (("",), (1,)),
                                               (("r",), (-1,))])
def test_an_expert_batch_names_at_most_a_traced_request_per_row_each_with_its_step(traced, steps):
    ids2 = WireTensor.from_array(np.array([[0, 1], [2, 3]], np.int32))
    with pytest.raises(WireError, match="traced"):
        ExpertBatch("b", 0, 1, hidden(2), ids2, f32(2, 2), traced=traced, traced_steps=steps).check()
