"""Which connections of a one-machine fleet cross an emulated WAN link, and the dial map that sends them there. Pure.

Every slot's daemon listens on loopback: libp2p on one port, the TLS data plane on another. A connection between
two slots of one region goes straight to those ports. For a slot of another region, the link emulator listens on
a port of its own per (dialling region, slot, port) and forwards there with the region pair's delay (half the
round trip each way) and the fleet's uplink as its bandwidth; each daemon's dial map (`swarmd join --dial-map`)
replaces the slot's address by that emulator port. So the slots of a region share each link into another
region's slot, and libp2p and the data plane cross it alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from planner.plan_file import Fleet

HOST = "127.0.0.1"


@dataclass(frozen=True)
class SlotPorts:
    swarm: int  # libp2p
    data: int  # the TLS data plane


@dataclass(frozen=True)
class EmulatedLink:
    name: str  # "r0->r1-4090-1:swarm": from region 0 to that slot's libp2p port
    listen: int
    target: int
    delay_ms: float  # one way, in each direction
    bandwidth_mbit: float  # each direction


@dataclass(frozen=True)
class Wan:
    links: tuple[EmulatedLink, ...]
    dial_maps: dict[str, tuple[str, ...]]  # slot -> its `--dial-map` entries


def emulated_wan(fleet: Fleet, ports: Mapping[str, SlotPorts], free_port: Callable[[], int]) -> Wan:
    links: list[EmulatedLink] = []
    dial_maps: dict[str, list[str]] = {s.name: [] for s in fleet.slots}
    for region in range(fleet.regions):
        for target in fleet.slots:
            if target.region == region:
                continue
            one_way = fleet.rtt_ms[region][target.region] / 2
            for kind, port in (("swarm", ports[target.name].swarm), ("data", ports[target.name].data)):
                link = EmulatedLink(f"r{region}->{target.name}:{kind}", free_port(), port, one_way, fleet.uplink_mbit)
                links.append(link)
                for dialler in fleet.slots:
                    if dialler.region == region:
                        dial_maps[dialler.name].append(f"{HOST}:{port}={HOST}:{link.listen}")
    return Wan(tuple(links), {name: tuple(entries) for name, entries in dial_maps.items()})
