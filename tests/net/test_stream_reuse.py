"""A stream to a peer reuses any live connection to it, whichever side dialled: a daemon nobody can dial (here it
announces a port where nothing listens, as one behind NAT is undialable) is still reached over the connection it
opened itself, for every protocol, without a dial."""

from __future__ import annotations

import trio

from swarmd.config import LOCAL_TEST
from swarmd.net.identity import load_or_create_identity
from swarmd.net.libp2p_network import Libp2pNetwork
from swarmd.net.streams import read_frame, write_frame

ECHO = "/test/echo/1.0.0"


async def echo(peer: str, stream) -> None:
    while True:
        await write_frame(stream, await read_frame(stream, 1 << 16))


async def test_streams_to_an_undialable_peer_ride_the_connection_it_opened(tmp_path):
    loop = ["/ip4/127.0.0.1/tcp/0"]
    hidden = Libp2pNetwork(load_or_create_identity(tmp_path / "h"), loop, ["/ip4/127.0.0.1/tcp/1"], timings=LOCAL_TEST)
    public = Libp2pNetwork(load_or_create_identity(tmp_path / "p"), loop, timings=LOCAL_TEST)
    async with trio.open_nursery() as nursery:
        await nursery.start(hidden.run)
        await nursery.start(public.run)
        hidden.serve(ECHO, echo)
        assert hidden.addresses() == [f"/ip4/127.0.0.1/tcp/1/p2p/{hidden.peer_id}"]
        await hidden.connect(public.peer_id, public.addresses())  # the hidden one dials out
        with trio.fail_after(10):
            for _ in range(3):
                stream = await public.open_stream(hidden.peer_id, ECHO)
                await write_frame(stream, b"over your own connection")
                assert await read_frame(stream, 1 << 16) == b"over your own connection"
                await stream.close()
        conns = public.host.get_network().connections[_id(hidden.peer_id)]
        assert len(conns) == 1 and conns[0].muxed_conn.is_initiator_value is False  # the inbound one, no new dial
        nursery.cancel_scope.cancel()


def _id(peer: str):
    from libp2p.peer.id import ID

    return ID.from_base58(peer)
