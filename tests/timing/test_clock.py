"""Clock offsets between daemons: the NTP-style estimate, alone and over the swarm's probe exchange with an
injected skew."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from swarmd.config import LAN
from swarmd.net.identity import Signer, peer_id_of
from swarmd.observe.clock import ClockOffsets, ClockSample
from swarmd.swarm.service import PROBE_PROTOCOL, SwarmService, SwarmSettings
from swarmd.testing.memory_network import MemoryHub
from tests.security.helpers import planner
from tests.swarm.swarm_helpers import descriptor, key

A, B = (peer_id_of(key(n)) for n in (1, 2))


def exchange(skew: float, there: float, back: float, held: float, t0: float = 100.0) -> tuple[float, ...]:
    """The four readings of one probe to a peer whose clock reads `skew` ahead of ours."""
    t1 = t0 + there + skew
    t2 = t1 + held
    t3 = t2 - skew + back
    return t0, t1, t2, t3


def test_a_symmetric_exchange_gives_the_exact_offset_and_the_round_trip():
    s = ClockSample.of(*exchange(skew=2.5, there=0.010, back=0.010, held=0.003))
    assert s.offset == pytest.approx(2.5)
    assert s.delay == pytest.approx(0.020)


@pytest.mark.parametrize("skew", [-7200.0, -0.25, 0.0, 0.004, 31.5])
def test_an_asymmetric_exchange_is_off_by_at_most_half_the_delay(skew):
    s = ClockSample.of(*exchange(skew, there=0.030, back=0.002, held=0.001))
    assert abs(s.offset - skew) <= s.error + 1e-9
    assert s.offset - skew == pytest.approx((0.030 - 0.002) / 2)


def test_the_estimate_is_the_sample_with_the_least_delay():
    clocks = ClockOffsets()
    clocks.add(B, *exchange(1.0, there=0.050, back=0.001, held=0.0))  # queued on the way there: 25 ms off
    clocks.add(B, *exchange(1.0, there=0.001, back=0.001, held=0.0, t0=101.0))  # quick and even
    clocks.add(B, *exchange(1.0, there=0.001, back=0.040, held=0.0, t0=102.0))
    assert clocks.offset(B) == pytest.approx(1.0)
    assert clocks.best(B).delay == pytest.approx(0.002)
    assert clocks.offset(A) is None


def test_old_samples_leave_the_filter():
    clocks = ClockOffsets(keep=2)
    clocks.add(B, *exchange(5.0, there=0.0, back=0.0, held=0.0))
    clocks.add(B, *exchange(6.0, there=0.01, back=0.01, held=0.0))
    clocks.add(B, *exchange(6.0, there=0.02, back=0.02, held=0.0))
    assert clocks.offset(B) == pytest.approx(6.0)  # the clock was stepped: the perfect old sample is gone


def test_impossible_readings_are_ignored():
    clocks = ClockOffsets()
    assert clocks.add(B, 10.0, 5.0, 6.0, 9.0) is None  # the answer came back before it was sent
    assert clocks.add(B, 10.0, 6.0, 5.0, 11.0) is None  # the peer answered before it received
    assert clocks.offset(B) is None


@pytest.mark.parametrize("skew", [-3600.0, 0.0, 42.125])
def test_probes_between_two_swarm_services_measure_an_injected_skew(skew):
    """B's clock reads `skew` ahead: A's probes over the (in-memory) probe protocol find it within the error
    they report, which is half their round trip."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            hub = await nursery.start(MemoryHub().run)
            net_a, net_b = hub.endpoint(A), hub.endpoint(B)
            settings = SwarmSettings("clock", LAN)
            svc_a = SwarmService(net_a, Signer(key(1)), settings, describe_self=lambda: descriptor(A),
                                 make_plan=planner)
            svc_b = SwarmService(net_b, Signer(key(2)), settings, describe_self=lambda: descriptor(B),
                                 make_plan=planner, clock=lambda: time.perf_counter() + skew)
            net_b.serve(PROBE_PROTOCOL, svc_b._serve_probe)
            svc_a._nursery = nursery
            for _ in range(5):
                await svc_a._probe(B)
                await trio.sleep(0.25)  # within the probe rate limit
            best = svc_a.clocks.best(B)
            assert best is not None
            assert abs(best.offset - skew) <= best.error + 1e-6
            assert best.error < 0.05
            assert svc_a.stats["probes_failed"] == 0
            nursery.cancel_scope.cancel()

    trio.run(main)
