"""Frames and tensors: what goes in comes out, and what a peer should not send is refused by name."""

from __future__ import annotations

import cbor2
import numpy as np
import pytest

from swarmd.errors import LocalProtocolError
from swarmd.wire.codec import WireError, WireTensor, decode_cbor


def test_float32_tensors_travel_bit_exactly_including_specials():
    values = np.array([[0.0, -0.0, 1e-45, 3.4e38, np.inf, -np.inf, np.nan, 1 / 3]], dtype=np.float32)
    back = WireTensor.from_cbor(cbor2.loads(cbor2.dumps(WireTensor.from_array(values).to_cbor()))).to_array()
    assert back.dtype == np.float32
    assert back.tobytes() == values.tobytes()


def test_tensor_bytes_are_little_endian():
    t = WireTensor.from_array(np.array([1], dtype=">i4"))
    assert t.dtype == "int32" and t.data == b"\x01\x00\x00\x00"


@pytest.mark.parametrize(("wire_dtype", "max_rel"), [("float16", 2**-11), ("bfloat16", 2**-8)])
def test_lossy_wire_dtypes_round_to_nearest(wire_dtype, max_rel):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 576)) * 3).astype(np.float32)
    t = WireTensor.from_array(x, wire_dtype)
    assert t.nbytes == x.size * 2
    back = t.to_array(np.float32)
    rel = np.abs(back - x) / np.abs(x)
    assert rel.max() <= max_rel * 1.0001


def test_float16_refuses_values_it_would_turn_into_infinity():
    x = np.array([[1.0, 22511.7, -65504.0]], np.float32)
    assert np.array_equal(WireTensor.from_array(x, "float16").to_array(np.float32), np.round(x))
    with pytest.raises(LocalProtocolError, match="do not fit float16"):
        WireTensor.from_array(np.array([[7e4]], np.float32), "float16")
    assert WireTensor.from_array(np.array([[7e4]], np.float32), "bfloat16").to_array()[0, 0] == pytest.approx(7e4, rel=1e-2)


def test_bfloat16_rounds_half_to_even_and_keeps_nan():
    bits = lambda v: WireTensor.from_array(np.array([v], np.float32), "bfloat16").data  # noqa: E731
    assert bits(1.0) == (0x3F80).to_bytes(2, "little")
    # 1 + 2^-8 is exactly halfway between 1.0 and the next bfloat16: ties go to the even mantissa (1.0).
    assert bits(1 + 2**-8) == (0x3F80).to_bytes(2, "little")
    assert bits(1 + 3 * 2**-8) == (0x3F82).to_bytes(2, "little")
    assert np.isnan(WireTensor.from_array(np.array([np.nan], np.float32), "bfloat16").to_array()[0])


def test_integer_data_cannot_be_sent_as_a_float_wire_dtype():
    with pytest.raises(LocalProtocolError):
        WireTensor.from_array(np.arange(3, dtype=np.int32), "float16")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"dtype": "float64", "shape": [1], "data": b"\0" * 8}, "unknown dtype"),
        ({"dtype": "float32", "shape": [2], "data": b"\0" * 4}, "needs 8 bytes"),
        ({"dtype": "float32", "shape": [-1], "data": b""}, "not a list of sizes"),
        ({"dtype": "float32", "shape": [1, 1, 1, 1, 1], "data": b"\0" * 4}, "at most 4"),
        ({"dtype": "float32", "shape": [True], "data": b"\0" * 4}, "not a list of sizes"),
        ({"dtype": "float32", "shape": [1], "data": "abcd"}, "byte string"),
        ({"dtype": "float32", "shape": [1], "data": b"\0" * 4, "extra": 1}, "exactly dtype, shape and data"),
        ([1, 2, 3], "exactly dtype, shape and data"),
    ],
)
def test_bad_tensors_are_refused_with_the_reason(value, why):
    with pytest.raises(WireError, match=why) as info:
        WireTensor.from_cbor(value)
    assert info.value.code == "bad_tensor"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"\xff", "not valid CBOR"),
        (b"\x01\x02", "after the CBOR value"),
        (cbor2.dumps(cbor2.CBORTag(1, 0)), "tag 1"),  # would decode to a datetime
        (cbor2.dumps(cbor2.CBORTag(35, "a+")), "tag 35"),  # would compile a regular expression
        (cbor2.dumps(cbor2.CBORTag(28, [1])), "tag 28"),  # shared references can build cycles
        (b"\x9f\x01\xff", "not valid CBOR"),  # indefinite-length array
        (b"\xa2\x61a\x01\x61a\x02", "not valid CBOR"),  # duplicate map key
        (b"\x81" * 20 + b"\x00", "not valid CBOR"),  # nesting deeper than any message
        (b"\x5b" + (1 << 62).to_bytes(8, "big"), "not valid CBOR"),  # a claimed 4 EiB byte string
        (b"\x62\xff\xfe", "not valid CBOR"),  # invalid UTF-8
    ],
)
def test_strict_cbor_refuses_what_a_message_never_contains(body, why):
    with pytest.raises(WireError, match=why) as info:
        decode_cbor(body)
    assert info.value.code == "not_cbor"
