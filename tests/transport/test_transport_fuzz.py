"""Fuzzing a live transport's link handler: every random or mutated frame is answered (an ack, an error or a
pong) within a deadline, the transport keeps running, and an honest peer is served afterwards."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.net.framing import HEADER
from swarmd.net.gate import GuardLimits
from swarmd.transport.transport import TransportConfig
from swarmd.wire import Ack, Error, Pong
from swarmd.wire.messages import ACTOR_MESSAGES
from tests.transport.memnet import MemoryNet
from tests.wire.wire_examples import EXAMPLES, VALID_BODIES, mutate

pytestmark = pytest.mark.slow  # a few seconds
FRAMES_PER_EXAMPLE = 170


async def answer_every_frame(bodies: list[bytes]) -> None:
    async with trio.open_nursery() as nursery:
        net = MemoryNet(nursery)
        honest = await net.add("honest")
        b = await net.add("b", TransportConfig(max_frame=1 << 16))
        net.endpoints["b"].gate.limits = GuardLimits(bad_frames=len(bodies) + 1)

        async def accept(peer, msg):
            return None

        for msg_type in ACTOR_MESSAGES:
            b.route(msg_type, accept)
        link = await net.raw_link("fuzzer", "b")
        for body in bodies:
            with trio.fail_after(5):
                await link.write(HEADER.pack(len(body)) + body)
                reply = await link.reply()
            assert reply is not None, "the link closed on a frame that fits the limit"
            assert isinstance(reply.msg, Ack | Error | Pong)
            if isinstance(reply.msg, Error):
                assert reply.msg.code and reply.msg.message
        assert b.running
        await honest.send("b", EXAMPLES[0])
        nursery.cancel_scope.cancel()


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_random_and_mutated_frames_each_get_an_answer(rng: random.Random):  # 10,200 frames
    bodies = []
    for _ in range(FRAMES_PER_EXAMPLE):
        kind = rng.random()
        if kind < 0.2:
            bodies.append(rng.randbytes(rng.randrange(64)))
        elif kind < 0.3:
            bodies.append(rng.choice(VALID_BODIES))
        else:
            bodies.append(mutate(rng.choice(VALID_BODIES), rng))
    trio.run(answer_every_frame, bodies, clock=trio.testing.MockClock(autojump_threshold=0))
