"""Which connections of a one-machine fleet cross the emulated WAN, and each daemon's dial map."""

from __future__ import annotations

import itertools

from planner.plan_file import fleet_of
from swarmd.cluster.wan import SlotPorts, emulated_wan
from swarmd.net.dial_map import DialMap

FLEET = fleet_of(["a0", "b1", "c0", "d1", "e1"], ["RTX 4090"] * 5, [1 << 30] * 5, [0, 1, 0, 1, 1],
                 [[1.0, 80.0], [80.0, 2.0]], 50.0)
PORTS = {name: SlotPorts(4000 + i, 5000 + i) for i, name in enumerate(FLEET.names)}


def test_each_slot_is_reached_from_the_other_region_through_its_own_links_and_directly_from_its_own():
    ports = itertools.count(7000)
    wan = emulated_wan(FLEET, PORTS, lambda: next(ports))
    assert len(wan.links) == 5 * 2  # one region dials each slot across, on its libp2p and data plane ports
    into_b1 = {link.name: link for link in wan.links if "->b1" in link.name}
    assert set(into_b1) == {"r0->b1:swarm", "r0->b1:data"}
    assert {(link.target, link.delay_ms, link.bandwidth_mbit) for link in into_b1.values()} == {
        (4001, 40.0, 50.0), (5001, 40.0, 50.0)}
    a0 = DialMap.parse(wan.dial_maps["a0"]).routes
    c0 = DialMap.parse(wan.dial_maps["c0"]).routes
    assert a0 == c0  # the slots of a region share each link into another region
    assert a0[("127.0.0.1", 4001)] == ("127.0.0.1", into_b1["r0->b1:swarm"].listen)
    assert a0[("127.0.0.1", 5001)] == ("127.0.0.1", into_b1["r0->b1:data"].listen)
    assert ("127.0.0.1", 4002) not in a0 and ("127.0.0.1", 5002) not in a0  # c0: same region, direct
    assert set(DialMap.parse(wan.dial_maps["d1"]).routes) == {("127.0.0.1", p) for p in (4000, 5000, 4002, 5002)}


def test_one_region_needs_no_emulator():
    one = fleet_of(["a", "b"], ["x", "y"], [1, 1], [0, 0], [[1.0]], 100.0)
    wan = emulated_wan(one, {"a": SlotPorts(1, 2), "b": SlotPorts(3, 4)}, lambda: 9)
    assert wan.links == () and wan.dial_maps == {"a": (), "b": ()}
