"""A speculative step on the wire: the hot lane's binary layout has no room for a draft, so a Forward that carries
one (or hands the loop back to the chain) travels as the CBOR envelope, whole."""

from __future__ import annotations

import numpy as np
import pytest

from swarmd.net.framing import HEADER
from swarmd.wire import Forward, WireTensor
from swarmd.wire.binary import decode_body, encode_frame, is_binary
from swarmd.wire.messages import Draft


def ids(*values: int) -> WireTensor:
    return WireTensor.from_array(np.array(values, np.int32))


@pytest.mark.parametrize("msg", [
    Forward("req", 6, 0, 20, "head", tokens=ids(5, 6, 7), draft=Draft(ids(6, 7))),
    Forward("req", 6, 0, 20, "head", tokens=ids(5), chain=True),
], ids=["draft", "chain"])
def test_a_speculative_forward_keeps_its_draft_and_its_chain_flag_in_a_lane_frame(msg):
    frame = encode_frame(msg, 3)
    assert not is_binary(frame[4:]) and len(frame) - 4 == HEADER.unpack(frame[:4])[0]
    assert decode_body(frame[4:]).msg == msg


def test_a_speculative_step_without_drafts_is_a_plain_binary_decode_step():
    msg = Forward("req", 6, 0, 20, "head", tokens=ids(5))
    frame = encode_frame(msg, 3)
    assert is_binary(frame[4:]) and decode_body(frame[4:]).msg == msg
