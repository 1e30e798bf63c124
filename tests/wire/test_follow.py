"""The frame a link brings next: recognised by its bytes when it is the step after a checked one, and nothing else;
framed from the bytes laid out once exactly as the encoder frames it."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.wire import Forward, Sampling, Token, WireTensor
from swarmd.wire.binary import decode_body, encode_frame
from swarmd.wire.follow import Follower, NextForward, NextToken

WIDTH = 16


def row(seed: int, dtype: str = "float32") -> WireTensor:
    return WireTensor.from_array(np.random.default_rng(seed).standard_normal((1, WIDTH)).astype(dtype))


def step(n: int, seed: int = 0, **fields) -> Forward:
    return Forward(fields.pop("request_id", "req-1.r2"), n, fields.pop("hop", 2), 40 + n,
                   fields.pop("head", "12D3KooWhead"), hidden=fields.pop("hidden", row(seed)), epoch=5, **fields)


def after(msg: Forward | Token) -> Follower:
    this = NextForward.of(msg) if isinstance(msg, Forward) else NextToken.of(msg)
    assert this is not None
    return Follower(this.then())


def body(msg: Forward | Token, seq: int) -> bytes:
    return encode_frame(msg, seq)[4:]


@settings(max_examples=40, deadline=None)
@given(seq=st.integers(0, 2**63 - 1), seed=st.integers(0, 1000), dtype=st.sampled_from(["float32", "float16"]))
def test_the_step_after_a_checked_one_is_recognised_with_its_seq_and_its_rows_bytes(seq, seed, dtype):
    follower = after(step(7, hidden=row(0, dtype)))
    nxt = step(8, seed, hidden=row(seed, dtype))
    assert follower.seq(body(nxt, seq)) == seq
    assert bytes(follower.free_bytes(body(nxt, seq))) == bytes(nxt.hidden.data)


@settings(max_examples=60, deadline=None)
@given(at=st.integers(0, 200), flip=st.integers(1, 255))
def test_a_frame_that_differs_anywhere_but_in_its_seq_and_rows_is_not_recognised(at, flip):
    follower = after(step(7))
    data = bytearray(body(step(8, 3), 99))
    free = follower.free_bytes(bytes(data))
    lo = len(data) - len(free)
    at = at % lo
    if 2 <= at < 10:  # the seq: any value is the frame's own
        return
    data[at] ^= flip
    assert follower.seq(bytes(data)) is None


def test_another_step_position_request_head_hop_shape_or_layout_is_not_the_one_expected():
    follower = after(step(7))
    assert follower.seq(body(step(8), 1)) == 1
    for other in (step(9), step(7), dataclasses.replace(step(8), start_pos=49), step(8, request_id="req-2"),
                  step(8, head="12D3KooWother"), step(8, hop=3),
                  step(8, hidden=WireTensor.from_array(np.zeros((1, WIDTH + 1), np.float32))),
                  step(8, hidden=WireTensor.from_array(np.zeros((2, WIDTH), np.float32)))):
        assert follower.seq(body(other, 1)) is None, other
    assert NextForward.of(step(8, sampling=Sampling())) is None  # no binary layout: never expected


def test_the_token_after_a_plain_one_is_recognised_and_one_with_log_probs_or_a_finish_is_not():
    follower = after(Token("req", 4, 17))
    assert follower.seq(body(Token("req", 5, 123), 8)) == 8 and follower.token(body(Token("req", 5, 123), 8)) == 123
    for other in (Token("req", 6, 1), Token("req", 5, 1, -0.5), Token("req", 5, 1, hop=1),
                  Token("req", 5, 1, finish="stop"), Token("rex", 5, 1), Token("req", 5, 1, None, (3,), (-1.0,))):
        assert follower.seq(body(other, 8)) is None, other
    assert NextToken.of(Token("req", 4, 17, -0.1)) is None and NextToken.of(Token("req", 4, 1, finish="length")) is None


def test_the_frame_after_the_next_is_expected_once_the_next_came():
    follower = after(step(7)).then()
    assert follower.seq(body(step(9, 4), 5)) == 5 and follower.seq(body(step(8), 5)) is None


@settings(max_examples=30, deadline=None)
@given(seq=st.integers(0, 2**63 - 1), seed=st.integers(0, 1000), token=st.integers(0, 2**40))
def test_a_message_the_layout_describes_is_framed_as_the_encoder_frames_it(seq, seed, token):
    this = NextForward.of(step(7))
    assert this is not None
    forward = Follower(this.then())
    msg = step(8, seed)
    assert forward.expected.describes(msg) and forward.frame(seq, msg) == encode_frame(msg, seq)
    assert decode_body(forward.frame(seq, msg)[4:]).msg == msg
    tok = Follower(NextToken("req", 5, 0))
    assert tok.frame(seq, Token("req", 5, token)) == encode_frame(Token("req", 5, token), seq)


def test_a_message_that_differs_in_a_field_the_layout_fixes_is_not_described():
    expected = NextForward.of(step(8))
    assert expected is not None and expected.describes(step(8, 9))
    for other in (step(9), dataclasses.replace(step(8), start_pos=1), dataclasses.replace(step(8), epoch=6),
                  step(8, hop=3), step(8, request_id="x"), step(8, head="y"), step(8, all_logits=True),
                  step(8, resume_of="req-1.r1"), step(8, chain=True), step(8, hidden=row(0, "float16")),
                  Token("req-1.r2", 8, 1)):
        assert not expected.describes(other), other
    token = NextToken("req", 5, 0)
    assert token.describes(Token("req", 5, 9))
    for other in (Token("req", 5, 9, hop=1), Token("req", 5, 9, finish="stop"), Token("req", 6, 9),
                  Token("req", 5, 9, -0.1)):
        assert not token.describes(other), other
