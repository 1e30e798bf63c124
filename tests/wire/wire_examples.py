"""Shared examples: one or more valid instances of every message type."""

from __future__ import annotations

import random

import numpy as np

from swarmd.wire import (
    Ack,
    Cancel,
    Draft,
    Error,
    ExpertBatch,
    ExpertResult,
    Forward,
    Hello,
    Logprobs,
    Ping,
    Sampling,
    Speculate,
    Token,
    TraceQuery,
    TraceSpans,
    Verified,
    WireTensor,
    encode,
)

HIDDEN = 576


def hidden(rows=1, width=HIDDEN, dtype=np.float32, wire_dtype=None):
    return WireTensor.from_array(np.arange(rows * width, dtype=dtype).reshape(rows, width) / 7, wire_dtype)


def ids(*values, dtype=np.int32):
    return WireTensor.from_array(np.array(values, dtype=dtype))


def f32(*shape):
    return WireTensor.from_array(np.ones(shape, np.float32))


EXAMPLES = [
    Forward("req-1", 0, 0, 0, "head-peer", tokens=ids(1, 2, 3), sampling=Sampling(0.7, 0.9, 40, 1234, 5)),
    Forward("req-1", 4, 2, 7, "head-peer", hidden=hidden(), epoch=3, all_logits=True),
    Forward("req-1", 4, 2, 7, "head-peer", hidden=hidden(2, wire_dtype="bfloat16")),
    Token("req-1", 4, 42, logprob=-0.25, top_ids=(42, 7), top_logprobs=(-0.25, -1.5), hop=1),
    Logprobs("req-1", 0, f32(3), WireTensor.from_array(np.zeros((3, 2), np.int32)), f32(3, 2)),
    Cancel("req-1", "client went away"),
    Error("bad_shape", "hidden has width 5", request_id="req-1", step=2, hop=1),
    ExpertBatch("b-9", 3, 5, hidden(4), WireTensor.from_array(np.array([[0, 3]] * 4, np.int32)), f32(4, 2)),
    ExpertBatch("b-10", 4, 5, hidden(2), WireTensor.from_array(np.array([[0, 3]] * 2, np.int32)), f32(2, 2),
                traced=("req-2",), traced_steps=(6,)),
    ExpertResult("b-9", 3, 5, hidden(4)),
    Forward("req-2", 0, 0, 0, "head-peer", tokens=ids(7), sampling=Sampling(seed=9, trace=True)),
    Forward("req-2.r2", 5, 1, 0, "head-peer", hidden=hidden(3), sampling=Sampling(seed=9), resume_of="req-2.r1"),
    TraceQuery("req-2", hop=1),
    TraceSpans("req-2", b"\x80", received=12.5, answered=12.625, hop=1),
    Forward("req-3", 6, 0, 20, "head-peer", tokens=ids(5, 6, 7), draft=Draft(ids(6, 7))),
    Forward("req-3", 6, 1, 20, "head-peer", hidden=hidden(3), draft=Draft(ids(6, 7))),
    Verified("req-3", 6, (6, 7, 11), drafted=2),
    Forward("req-3", 9, 0, 23, "head-peer", tokens=ids(5), chain=True),
    Speculate("req-3", 14, 3),
    Verified("req-3", 9, (4,), logprobs=(-0.5,), top_ids=(4, 8), top_logprobs=(-0.5, -1.0), finish="stop"),
    Ack(),
    Ping(),
    Hello(1 << 20),
]


def body_of(msg, seq=0):
    return encode(msg, seq)[4:]


def mutate(body: bytes, rng: random.Random) -> bytes:
    """1-4 random edits of a valid frame: bit flips, overwritten, cut, inserted or deleted bytes, splices."""
    out = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        op, i = rng.choice(["flip", "set", "cut", "insert", "delete", "splice"]), rng.randrange(max(1, len(out)))
        if op == "flip" and out:
            out[i] ^= 1 << rng.randrange(8)
        elif op == "set" and out:
            out[i] = rng.randrange(256)
        elif op == "cut":
            del out[i:]
        elif op == "insert":
            out[i:i] = rng.randbytes(rng.randint(1, 9))
        elif op == "delete":
            del out[i : i + rng.randint(1, 16)]
        else:
            other = rng.choice(VALID_BODIES)
            out[i:] = other[rng.randrange(len(other) + 1) :]
    return bytes(out)


VALID_BODIES = [body_of(m, seq=i + 1) for i, m in enumerate(EXAMPLES)]
