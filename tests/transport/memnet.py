"""ActorTransports wired together by trio in-memory streams, for fast tests in virtual time.

A test fake of the network only: the transports are the real ones. Links can be broken, peers taken down,
and a test can open a raw stream into a transport to write frames by hand.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from functools import partial

import trio
import trio.testing

from swarmd.transport.transport import (
    ActorTransport,
    ByteStream,
    LinkError,
    TransportConfig,
    TrioStream,
    read_frame,
)
from swarmd.wire import Envelope, Message, encode

Wrap = Callable[[str, str, ByteStream], ByteStream]


class MemoryNet:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.transports: dict[str, ActorTransport] = {}
        self.down: set[str] = set()
        self.unserved: set[str] = set()  # dials succeed but nobody reads the other end (a hung peer)
        self.dials: Counter[tuple[str, str]] = Counter()
        self.dial_times: list[float] = []
        self.wrap: Wrap | None = None
        self._ends: list[trio.abc.Stream] = []

    async def add(self, name: str, config: TransportConfig | None = None, **kwargs) -> ActorTransport:
        transport = ActorTransport(partial(self._open, name), config, local_peer=name, rng=random.Random(name), **kwargs)
        await self.nursery.start(transport.run)
        self.transports[name] = transport
        return transport

    async def _open(self, src: str, dst: str) -> ByteStream:
        self.dials[(src, dst)] += 1
        self.dial_times.append(trio.current_time())
        if dst in self.down or dst not in self.transports:
            raise LinkError(f"{dst} is unreachable")
        near, far = trio.testing.memory_stream_pair()
        self._ends += [near, far]
        if dst not in self.unserved:
            self.nursery.start_soon(self.transports[dst].serve, src, TrioStream(far))
        stream: ByteStream = TrioStream(near)
        return self.wrap(src, dst, stream) if self.wrap else stream

    async def break_links(self) -> None:
        """Drop every open link at once, as a dead connection would."""
        ends, self._ends = self._ends, []
        for end in ends:
            await end.aclose()

    def raw_link(self, src: str, dst: str) -> RawLink:
        """A stream into `dst` as if from `src`, written frame by frame by the test."""
        near, far = trio.testing.memory_stream_pair()
        self._ends += [near, far]
        self.nursery.start_soon(self.transports[dst].serve, src, TrioStream(far))
        return RawLink(TrioStream(near))


class RawLink:
    def __init__(self, stream: TrioStream) -> None:
        self.stream = stream

    async def send(self, msg: Message, seq: int) -> None:
        await self.stream.write(encode(msg, seq))

    async def write(self, data: bytes) -> None:
        await self.stream.write(data)

    async def reply(self) -> Envelope | None:
        """The next frame the transport answered with; None once it closed the link."""
        try:
            return await read_frame(self.stream, 1 << 20)
        except (LinkError, trio.BrokenResourceError, trio.ClosedResourceError):
            return None
