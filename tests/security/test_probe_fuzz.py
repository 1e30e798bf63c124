"""Fuzzing the probe protocol as a daemon serves it (the stream guard around `SwarmService`'s probe handler):
10,000 random, mutated and valid inputs. Each is answered, within the guard's read timeout, by its echo (a
valid 8-byte probe) or by the stream closing; the daemon keeps answering honest probes. Virtual time."""

from __future__ import annotations

import random
import struct

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.config import LAN
from swarmd.net.gate import GuardLimits
from swarmd.net.identity import Signer, peer_id_of
from swarmd.net.streams import read_exact, read_frame, write_frame
from swarmd.swarm.service import PROBE_PROTOCOL, SwarmService, SwarmSettings
from swarmd.testing.memory_network import MemoryHub
from tests.security.helpers import planner
from tests.swarm.swarm_helpers import descriptor, key

pytestmark = pytest.mark.slow  # about 10 s
VICTIM, FUZZER, HONEST = (peer_id_of(key(n)) for n in (1, 2, 3))
INPUTS_PER_EXAMPLE = 100
# Limits high enough that the fuzzer is never cut off: this test is about each input's answer (the
# penalties have tests of their own).
PATIENT = GuardLimits(bad_frames=10**9, stream_opens_per_second=1e9, stream_open_burst=10**9,
                      probes_per_second=1e9, probe_burst=10**9)
LEN = struct.Struct(">I")


def probe_input(rng: random.Random) -> bytes:
    nonce = LEN.pack(8) + rng.randbytes(8)
    kind = rng.random()
    if kind < 0.3:
        return nonce
    if kind < 0.45:
        return rng.randbytes(rng.randint(1, 40))
    if kind < 0.6:
        return LEN.pack(rng.choice([0, 1, 7, 9, 64, 2**31, 2**32 - 1])) + rng.randbytes(rng.randint(0, 12))
    if kind < 0.75:
        return nonce[: rng.randint(1, 11)]  # cut short: the rest never comes
    if kind < 0.9:
        return nonce + rng.randbytes(rng.randint(1, 12))  # a good probe, then garbage
    out = bytearray(nonce)
    out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


async def closes(stream) -> bool:
    """Read until the victim closes the stream (True), whatever it sends before that."""
    while True:
        try:
            if not await stream.read(1024):
                return True
        except Exception:
            return True


def run_example(inputs: list[bytes]) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            hub = await nursery.start(MemoryHub().run)
            net = hub.endpoint(VICTIM, limits=PATIENT)
            svc = SwarmService(net, Signer(key(1)), SwarmSettings("fuzz", LAN), describe_self=lambda: descriptor(VICTIM),
                               make_plan=planner)
            net.serve(PROBE_PROTOCOL, svc._serve_probe)
            fuzzer, honest = hub.endpoint(FUZZER), hub.endpoint(HONEST)
            stream = None
            for raw in inputs:
                if stream is None:
                    stream = await fuzzer.open_stream(VICTIM, PROBE_PROTOCOL)
                await stream.write(raw)
                valid_first = raw[:4] == LEN.pack(8) and len(raw) >= 12
                with trio.fail_after(PATIENT.read_timeout + 5):
                    if valid_first:
                        assert await read_exact(stream, 12) == raw[:12]
                    if len(raw) != 12 or not valid_first:
                        assert await closes(stream)
                        stream = None
            probe = await honest.open_stream(VICTIM, PROBE_PROTOCOL)
            with trio.fail_after(5):
                await write_frame(probe, b"12345678")
                assert await read_frame(probe, 8) == b"12345678"
            await trio.sleep(1)
            # nothing leaks: the fuzzer holds only the stream it still has open, the honest member its own
            assert dict(net.guard.open) == {(HONEST, PROBE_PROTOCOL): 1, **({(FUZZER, PROBE_PROTOCOL): 1} if stream else {})}
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_every_probe_input_is_echoed_or_closes_the_stream(rng: random.Random):  # 10,000 inputs
    run_example([probe_input(rng) for _ in range(INPUTS_PER_EXAMPLE)])


def test_a_peer_that_keeps_sending_bad_probes_is_cut_off_and_others_are_still_answered():
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            hub = await nursery.start(MemoryHub().run)
            net = hub.endpoint(VICTIM)
            svc = SwarmService(net, Signer(key(1)), SwarmSettings("fuzz", LAN), describe_self=lambda: descriptor(VICTIM),
                               make_plan=planner)
            net.serve(PROBE_PROTOCOL, svc._serve_probe)
            fuzzer, honest = hub.endpoint(FUZZER), hub.endpoint(HONEST)
            for _ in range(net.gate.limits.bad_frames + 1):
                stream = await fuzzer.open_stream(VICTIM, PROBE_PROTOCOL)
                await stream.write(LEN.pack(9) + bytes(9))
                assert await closes(stream)
            assert net.gate.is_penalised(FUZZER, trio.current_time())
            await trio.sleep(1)  # the hang-up waits a moment, so that the peer can read why
            assert FUZZER not in net.connections
            with pytest.raises(Exception, match="penalised"):
                await fuzzer.open_stream(VICTIM, PROBE_PROTOCOL)
            probe = await honest.open_stream(VICTIM, PROBE_PROTOCOL)
            await write_frame(probe, b"12345678")
            assert await read_frame(probe, 8) == b"12345678"
            await trio.sleep(net.gate.limits.penalty + 2)  # the penalty ends; the peer may come back
            assert net.gate.expire(trio.current_time()) == [FUZZER]
            stream = await fuzzer.open_stream(VICTIM, PROBE_PROTOCOL)
            await write_frame(stream, b"abcdefgh")
            assert await read_frame(stream, 8) == b"abcdefgh"
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
