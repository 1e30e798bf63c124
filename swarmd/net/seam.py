"""The one network seam: gossip, dialing, streams to a peer, serving a protocol.

`swarmd.net.libp2p_network.Libp2pNetwork` implements it over py-libp2p; `swarmd.testing.memory_network.MemoryHub` gives an
in-memory twin so a whole swarm runs in one test process in virtual time. Everything above this
file (membership, election, actors) talks only to `Network`.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from swarmd.errors import RemoteProtocolError

if TYPE_CHECKING:
    from swarmd.net.gate import PeerGate


class Stream(Protocol):
    """A bidirectional byte stream to one peer. `read(n)` returns at most n bytes (short reads)."""

    async def read(self, n: int = -1) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


StreamHandler = Callable[[str, Stream], Awaitable[None]]  # (remote peer id, stream)


class PeerUnreachable(Exception):
    """Dialing a peer or opening a stream to it failed; the message says why, in one line."""


class StreamClosed(Exception):
    """The other side closed or reset the stream, or the connection under it broke."""


class BadFrame(StreamClosed, RemoteProtocolError):
    """The peer sent a frame that breaks the protocol (too large, wrong shape): the stream is given up and
    the peer gets a strike from the guard that serves it."""


@dataclass(frozen=True)
class GossipMessage:
    origin: str  # the publisher, as authenticated by the gossip layer
    data: bytes


class Network(Protocol):
    gate: PeerGate  # the allowlist, rates and penalties this endpoint enforces

    @property
    def peer_id(self) -> str: ...

    def addresses(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) that peers should dial to reach us."""
        ...

    async def publish(self, topic: str, data: bytes) -> None: ...

    async def subscribe(self, topic: str) -> trio.MemoryReceiveChannel[GossipMessage]:
        """Messages on `topic` from other peers (our own are filtered out)."""
        ...

    async def connect(self, peer_id: str, addresses: Sequence[str]) -> None:
        """Dial `peer_id` at `addresses` (or where we last saw it); raise PeerUnreachable."""
        ...

    def is_connected(self, peer_id: str) -> bool: ...

    def connected_peers(self) -> list[str]: ...

    def is_relayed(self, peer_id: str) -> bool:
        """Whether a stream to `peer_id` may go through a circuit relay (a connection to it is relayed)."""
        ...

    async def open_stream(self, peer_id: str, protocol: str) -> Stream:
        """A new stream speaking `protocol`, dialing first if needed; raise PeerUnreachable."""
        ...

    def serve(self, protocol: str, handler: StreamHandler) -> None:
        """Run `handler` for every inbound stream of `protocol`. Its exceptions are logged, never fatal."""
        ...

    def disconnects(self) -> trio.MemoryReceiveChannel[str]:
        """Peer ids whose last connection to us closed."""
        ...

    def hang_up(self, peer_id: str) -> None:
        """Close every connection to `peer_id` now; it may be dialled again at once."""
        ...

    def strike(self, peer_id: str, reason: str) -> None:
        """`peer_id` sent something that failed its checks; enough strikes cut it off for a while."""
        ...


# --- framing: 4-byte big-endian length, then the payload ------------------------------------
LENGTH = struct.Struct(">I")


async def read_exact(stream: Stream, n: int) -> bytes:
    """Exactly n bytes; streams return short reads (one noise frame at most per call)."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await stream.read(n - len(buf))
        except trio.Cancelled:
            raise
        except Exception as e:
            raise StreamClosed(f"stream broke after {len(buf)} of {n} bytes: {type(e).__name__}") from None
        if not chunk:
            raise StreamClosed(f"stream ended after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def read_frame(stream: Stream, max_bytes: int) -> bytes:
    (n,) = LENGTH.unpack(await read_exact(stream, LENGTH.size))
    if n > max_bytes:
        raise BadFrame(f"frame of {n} bytes is over the {max_bytes} byte limit")
    return await read_exact(stream, n)


async def write_frame(stream: Stream, payload: bytes) -> None:
    try:
        await stream.write(LENGTH.pack(len(payload)) + payload)  # one write per frame
    except trio.Cancelled:
        raise
    except Exception as e:
        raise StreamClosed(f"write failed: {type(e).__name__}: {e}") from None
