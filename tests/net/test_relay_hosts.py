"""Circuit relay v2 between three real hosts on loopback: a reservation, a dial through the relay (py-libp2p would
not use a relay address by itself), streams over the circuit, and a circuit replaced before the relay's byte limit."""

from __future__ import annotations

import trio

from swarmd.config import LOCAL_TEST
from swarmd.net.connectivity import ConnectivityConfig
from swarmd.net.identity import load_or_create_identity
from swarmd.net.libp2p_network import Libp2pNetwork
from swarmd.net.link_paths import connection_kinds
from swarmd.net.relay import RelayLimits
from swarmd.net.streams import read_frame, write_frame

ECHO = "/test/echo/1.0.0"
LOOP = ["/ip4/127.0.0.1/tcp/0"]


async def echo(peer: str, stream) -> None:
    while True:
        await write_frame(stream, await read_frame(stream, 1 << 20))


async def test_a_peer_is_reached_through_a_relay_and_circuits_are_replaced_before_the_byte_limit(tmp_path):
    limits = RelayLimits(circuit_bytes=400_000)
    relay = Libp2pNetwork(load_or_create_identity(tmp_path / "r"), LOOP, timings=LOCAL_TEST,
                          connectivity=ConnectivityConfig(relay_limits=limits))
    quiet = ConnectivityConfig(hole_punching=False)  # on loopback a hole punch would just dial directly
    a = Libp2pNetwork(load_or_create_identity(tmp_path / "a"), LOOP, timings=LOCAL_TEST, connectivity=quiet)
    b = Libp2pNetwork(load_or_create_identity(tmp_path / "b"), LOOP, timings=LOCAL_TEST, connectivity=quiet)
    async with trio.open_nursery() as nursery:
        for net in (relay, a, b):
            await nursery.start(net.run)
        b.serve(ECHO, echo)
        relay_addr = relay.bound_addresses()[0].rsplit("/p2p/", 1)[0]
        assert await b.connectivity.relay.reserve(relay.peer_id, (relay_addr,)) == ""
        circuit = b.connectivity.relay.circuit_addresses()[0]
        assert circuit == f"{relay_addr}/p2p/{relay.peer_id}/p2p-circuit/p2p/{b.peer_id}"

        await a.connect(b.peer_id, [circuit])  # only the relay address: the dial must go through it
        conns = a.host.get_network().connections[_id(b.peer_id)]
        assert connection_kinds(conns) == {"relayed"}
        assert a.connectivity.link_facts(b.peer_id).relay == relay.peer_id

        payload = bytes(range(256)) * 40  # 10 KiB
        sent = 0
        with trio.fail_after(60):
            while a.connectivity.relay.stats["circuits_rotated"] == 0 or sent < 40:
                stream = await a.open_stream(b.peer_id, ECHO)  # redials through the relay after a rotation
                try:
                    for _ in range(5):
                        await write_frame(stream, payload)
                        assert await read_frame(stream, 1 << 20) == payload
                        sent += 1
                except Exception:
                    await trio.sleep(1.2)  # the circuit was replaced under this stream: a new one follows
                finally:
                    await stream.reset()
        stats = a.connectivity.relay.status()
        assert stats["circuits_rotated"] >= 1 and stats["circuits_opened"] >= 2
        assert all(c["bytes"] < limits.circuit_bytes for c in stats["circuits"])
        assert relay.connectivity.relay.status()["reservations_held_here"] == 1
        nursery.cancel_scope.cancel()


def _id(peer: str):
    from libp2p.peer.id import ID

    return ID.from_base58(peer)
