"""Fuzzing the decoder: random bytes, random CBOR and mutated valid frames (about 12,000 in all).

Each input must end in a clean decode or a WireError with a known code — never another exception, never a
hang (hypothesis's per-example deadline of 10 s catches a decode gone quadratic or worse; a machine's stall
under load stays well within it).
"""

from __future__ import annotations

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.net.framing import HEADER, FrameTooLarge, frame
from swarmd.wire import FrameDecoder, WireError, decode
from tests.wire.wire_examples import VALID_BODIES, body_of, mutate

CODES = {
    "not_cbor", "bad_envelope", "unknown_type", "bad_version", "unknown_field", "missing_field", "bad_field",
    "bad_tensor", "bad_shape", "bad_dtype", "frame_too_large",
}
FUZZ = settings(deadline=10_000, suppress_health_check=[HealthCheck.too_slow], database=None)
pytestmark = pytest.mark.slow  # 10-20 s on a shared 2-core machine


def decodes_cleanly_or_is_refused(body: bytes) -> None:
    try:
        env = decode(body)
    except WireError as e:
        assert e.code in CODES, e
    else:
        assert decode(body_of(env.msg, env.seq)) == env  # whatever is accepted re-encodes to itself


@settings(FUZZ, max_examples=2000)
@given(st.lists(st.binary(max_size=4096), min_size=1, max_size=4))
def test_random_bytes(bodies):  # about 5,000 frames
    for body in bodies:
        decodes_cleanly_or_is_refused(body)


cbor_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64) + 1, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=6),
    max_leaves=8,
)
tags = st.sampled_from(["forward", "token", "logprobs", "cancel", "error", "expert_batch", "expert_result", "ack",
                        "ping", "pong", "hello", "attach", "nope"])
fields = st.sampled_from(["request_id", "step", "hop", "start_pos", "head", "tokens", "hidden", "epoch", "all_logits",
                          "sampling", "token", "code", "message", "batch_id", "block", "expert_ids", "gates", "dtype",
                          "shape", "data", "max_frame", "x"])


@settings(FUZZ, max_examples=300)
@given(st.one_of(
    cbor_values,
    st.fixed_dictionaries({"t": tags, "v": st.integers(0, 2), "seq": st.integers(-1, 2**64 - 1),
                           "body": st.dictionaries(fields, cbor_values, max_size=8)}),
))
def test_random_cbor_values_and_envelopes(value):  # 300 frames
    decodes_cleanly_or_is_refused(cbor2.dumps(value))


@settings(FUZZ, max_examples=500)
@given(st.randoms(use_true_random=False))
def test_mutated_valid_frames(rng):  # 6,000 frames: every valid example, mutated 12 times per draw
    for _ in range(12):
        decodes_cleanly_or_is_refused(mutate(rng.choice(VALID_BODIES), rng))


@settings(FUZZ, max_examples=300)
@given(st.lists(st.binary(max_size=300) | st.sampled_from(VALID_BODIES), max_size=8),
       st.lists(st.integers(1, 64), min_size=1, max_size=8), st.booleans())
def test_a_stream_of_frames_in_random_chunks(bodies, chunks, lie_about_length):  # about 1,200 frames
    stream = b"".join(frame(b) for b in bodies)
    if lie_about_length and stream:
        stream = HEADER.pack(np.uint32(len(stream) * 1000)) + stream
    dec, seen, pos, k = FrameDecoder(max_frame=16384), [], 0, 0
    try:
        while pos < len(stream):
            step = chunks[k % len(chunks)]
            dec.feed(stream[pos : pos + step])
            pos, k = pos + step, k + 1
            while (body := dec.next_frame()) is not None:
                seen.append(body)
                decodes_cleanly_or_is_refused(body)
    except FrameTooLarge as e:
        assert e.code == "frame_too_large"
    else:
        assert seen == (bodies if not lie_about_length else seen)
