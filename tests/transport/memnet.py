"""ActorTransports on the in-memory twin of the network (`swarmd.testing.memory_network`), for fast tests
in virtual time: the transports, links and streams are the daemon's own; only the wire is in memory.

`MemoryNet(nursery)` starts its hub; `await net.add(name, config)` makes an endpoint and a transport on it
(`nursery=` runs the transport in a test's own nursery, to stop it while its endpoint still serves links).
A test can take a peer off the wire (`down`: dials to it fail; `unserved`: dials succeed and nobody
answers), break every stream, wrap the dialer's ends, count dials, and open a raw link into a transport to
write frames by hand.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import trio

from swarmd.net.seam import Stream, StreamClosed
from swarmd.net.streams import read_frame
from swarmd.testing.memory_network import MemoryHub, MemoryNetwork
from swarmd.transport.links import PROTOCOL, start_actor_transport
from swarmd.transport.transport import ActorTransport, TransportConfig
from swarmd.wire import Envelope, Hello, Message, decode, encode


class MemoryNet:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.hub = MemoryHub()
        nursery.start_soon(self.hub.run)
        self.transports: dict[str, ActorTransport] = {}
        self.endpoints: dict[str, MemoryNetwork] = {}
        self.dial_times: list[float] = []

    @property
    def down(self) -> set[str]:
        return self.hub.refusing

    @property
    def unserved(self) -> set[str]:
        return self.hub.unserved

    @property
    def dials(self) -> Counter[tuple[str, str]]:
        return self.hub.stream_opens

    @property
    def wrap(self):
        return self.hub.wrap

    @wrap.setter
    def wrap(self, fn) -> None:
        self.hub.wrap = None if fn is None else lambda src, dst, protocol, stream: fn(src, dst, stream)

    async def add(self, name: str, config: TransportConfig | None = None, *, nursery: trio.Nursery | None = None,
                  on_undeliverable: Callable[[str, Message, str], None] | None = None) -> ActorTransport:
        """An endpoint `name` and its transport; the transport's tasks in `nursery` (the net's by default), so
        that a test can stop it alone."""
        await trio.lowlevel.checkpoint()
        endpoint = self.endpoints[name] = self.hub.endpoint(name)
        await self.nursery.start(endpoint.run)
        inner = endpoint.open_stream

        async def open_stream(peer: str, protocol: str, *, bulk: bool = False) -> Stream:
            self.dial_times.append(trio.current_time())
            return await inner(peer, protocol, bulk=bulk)

        endpoint.open_stream = open_stream  # type: ignore[method-assign]
        transport = self.transports[name] = await start_actor_transport(endpoint, nursery or self.nursery, config,
                                                                        rng=random.Random(name),
                                                                        on_undeliverable=on_undeliverable)
        return transport

    async def break_links(self) -> None:
        """Drop every open stream at once, as a dead connection would."""
        self.hub.reset()
        await trio.lowlevel.checkpoint()

    async def raw_link(self, src: str, dst: str) -> RawLink:
        """A link into `dst` as if from `src` (hello done), written frame by frame by the test."""
        if src not in self.hub.endpoints:
            endpoint = self.hub.endpoint(src)
            await self.nursery.start(endpoint.run)
        stream = await self.hub.endpoints[src].open_stream(dst, PROTOCOL, bulk=True)
        await stream.write(encode(Hello(1 << 20)))
        assert isinstance(decode(await read_frame(stream, 4096)).msg, Hello)
        return RawLink(stream)


class RawLink:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    async def send(self, msg: Message, seq: int) -> None:
        await self.stream.write(encode(msg, seq))

    async def write(self, data: bytes) -> None:
        await self.stream.write(data)

    async def reply(self) -> Envelope | None:
        """The next frame the transport answered with; None once it closed the link."""
        try:
            return decode(await read_frame(self.stream, 1 << 20))
        except StreamClosed:
            return None
