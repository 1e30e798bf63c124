"""The hot messages' binary layouts: the same messages as the CBOR envelope, and as strict about what they accept."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import LocalProtocolError
from swarmd.net.framing import HEADER
from swarmd.wire import Ack, ExpertBatch, ExpertResult, Forward, Sampling, Token, WireTensor, decode, encode
from swarmd.wire.binary import _DTYPE_CODES, ack_frame, decode_body, encode_body, encode_frame, is_binary
from swarmd.wire.codec import WireError


def hidden(rows: int = 1, width: int = 16, seed: int = 0) -> WireTensor:
    return WireTensor.from_array(np.random.default_rng(seed).standard_normal((rows, width), dtype=np.float32))


MESSAGES = [
    Forward("req-1.r2", 7, 3, 40, "12D3KooWhead", hidden=hidden(), epoch=5),
    Forward("req", 0, 0, 0, "head", tokens=WireTensor.from_array(np.array([1, 2, 3], np.int32))),
    Token("req", 4, 123, -0.25, (5, 6), (-1.0, -2.0), hop=1, finish="length"),
    Token("req", 4, 123),
    ExpertBatch("moe-1", 2, 3, hidden(2), WireTensor.from_array(np.array([[1, -1], [0, 2]], np.int32)),
                WireTensor.from_array(np.array([[0.5, 0.0], [0.25, 0.75]], np.float32)), traced=("req",),
                traced_steps=(9,)),
    ExpertResult("moe-1", 2, 3, hidden(2)),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.TAG)
def test_a_hot_message_decodes_to_what_the_cbor_envelope_gives(msg):
    frame = encode_frame(msg, 41)
    assert is_binary(frame[4:]) and len(frame) - 4 == HEADER.unpack(frame[:4])[0]
    env = decode_body(frame[4:])
    assert env.seq == 41 and env.msg == decode(encode(msg, 41)[4:]).msg


def test_a_forward_that_starts_or_moves_a_request_travels_as_cbor():
    first = Forward("req", 0, 0, 0, "head", tokens=WireTensor.from_array(np.array([1], np.int32)), sampling=Sampling())
    assert encode_body(first, 1) is None
    assert decode_body(encode_frame(first, 1)[4:]).msg == first  # the CBOR path, through the same decoder


def test_acks_are_twelve_bytes_and_decode_with_their_seq():
    env = decode_body(ack_frame(77)[4:])
    assert isinstance(env.msg, Ack) and env.seq == 77 and len(ack_frame(77)) == 4 + 10


def test_an_invalid_message_is_not_sent():
    bad = Forward("", 1, 1, 1, "head", hidden=hidden())
    with pytest.raises(LocalProtocolError):
        encode_frame(bad, 1)


def body(msg=MESSAGES[0], seq: int = 3) -> bytes:
    return encode_frame(msg, seq)[4:]


@pytest.mark.parametrize("mangle, code", [
    (lambda b: b[:-1], "bad_tensor"),  # the tensor is one byte short
    (lambda b: b + b"\0", "bad_envelope"),  # a byte after the message
    (lambda b: bytes([9]) + b[1:], "unknown_type"),
    (lambda b: b[:1] + bytes([2]) + b[2:], "bad_version"),
    (lambda b: b[:10] + struct.pack("<H", 3) + b"\xff\xfe\xfd" + b[22:], "bad_field"),  # not UTF-8
    (lambda b: b[:12], "bad_field"),  # cut inside a string
])
def test_a_broken_binary_body_is_refused_with_a_clear_code(mangle, code):
    with pytest.raises(WireError) as e:
        decode_body(mangle(body()))
    assert e.value.code == code


F32 = _DTYPE_CODES["float32"]


def forward_body(tensor_header: bytes, data: bytes) -> bytes:
    """A binary Forward whose tensor is written by hand."""
    name = b"req"
    return (struct.pack("<BBQ", 2, 1, 1) + struct.pack("<H", 3) + name + struct.pack("<H", 4) + b"head"
            + struct.pack("<QIQQ", 1, 1, 1, 0) + tensor_header + data)


@pytest.mark.parametrize("header, data, code", [
    (struct.pack("<BB", 9, 2) + struct.pack("<2I", 1, 4), bytes(16), "bad_tensor"),  # an unknown dtype
    (struct.pack("<BB", 2, 5) + struct.pack("<5I", 1, 1, 1, 1, 1), bytes(4), "bad_tensor"),  # 5 dimensions
    (struct.pack("<BB", F32, 2) + struct.pack("<2I", 1, 4), bytes(12), "bad_tensor"),  # 12 bytes for 16
    (struct.pack("<BB", F32, 1) + struct.pack("<I", 4), bytes(16), "bad_shape"),  # hidden rows must be 2-D
])
def test_a_tensor_that_does_not_add_up_is_refused(header, data, code):
    assert decode_body(forward_body(struct.pack("<BB", F32, 2) + struct.pack("<2I", 1, 4), bytes(16))).msg.rows == 1
    with pytest.raises(WireError) as e:
        decode_body(forward_body(header, data))
    assert e.value.code == code and e.value.request_id == "req"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_decodes_to_anything_but_a_wire_error(junk):
    try:
        decode_body(bytes([2, 1]) + junk)
    except WireError:
        pass
