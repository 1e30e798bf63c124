"""The one network seam: every byte between daemons goes through a `Network`.

Gossip (publish / subscribe), connections, and streams to a peer speaking a protocol. Control protocols
(probes, weights) open plain streams; the actor transport asks for `bulk` streams, which an implementation may
carry on a faster path (the libp2p one moves them to its pinned TLS data plane). Both ends see a `Stream`
either way, framed by `swarmd.net.framing`.

A bulk stream on such a path may also be taken off the event loop (`detachable(stream)`, then
`stream.detach()`): a `DetachedStream` is read by a reader of its own (a thread on the TLS data plane, a task in
the in-memory twin) and written from any thread, so that a token's bytes never wait for the event loop
(`swarmd.transport.lane`).

`swarmd.net.libp2p_network.Libp2pNetwork` implements it over py-libp2p; `swarmd.testing.memory_network` is its
in-memory twin, on which whole daemons run in one process in virtual time.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from swarmd.net.errors import BadFrame, PeerUnreachable, StreamClosed

if TYPE_CHECKING:
    from swarmd.net.gate import PeerGate
    from swarmd.net.stream_guard import StreamGuard


class Stream(Protocol):
    """A bidirectional byte stream to one peer. `read(n)` returns at most n bytes (short reads) and b'' once
    the peer has closed its side; a broken stream raises (StreamClosed, or the implementation's own error)."""

    async def read(self, n: int) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


class Reader(Protocol):
    """What a detached stream's reader calls, one call at a time, never from the event loop's thread on a real
    network (from its task in the twin). `tick` is called after every `data` and whenever the seconds it last
    returned have passed (None: only when data comes); `closed` once, last."""

    def data(self, chunk: bytes) -> None: ...

    def tick(self) -> float | None: ...

    def closed(self, reason: str) -> None: ...


class DetachedStream(Protocol):
    """A bulk stream off the event loop. `send` writes whole from any thread (blocking while the socket is
    full, at most `wait` s) and raises StreamClosed once the stream is gone; `close_now` closes it from any
    thread, and its reader then ends with `closed`."""

    def start(self, reader: Reader) -> None: ...

    def send(self, data: bytes, wait: float = ...) -> None: ...

    def close_now(self, reason: str = ...) -> None: ...


def detachable(stream: Stream) -> bool:
    """Whether `stream` can be taken off the event loop (`stream.detach()` -> DetachedStream)."""
    return callable(getattr(stream, "detach", None))


StreamHandler = Callable[[str, Stream], Awaitable[None]]  # (remote peer id, stream)
__all__ = ["BadFrame", "DetachedStream", "GossipMessage", "LinkInfo", "LinkPath", "Network", "PeerUnreachable",
           "Reader", "Stream", "StreamClosed", "StreamHandler", "detachable"]


@dataclass(frozen=True)
class GossipMessage:
    origin: str  # the publisher, as authenticated by the gossip layer
    data: bytes


class LinkPath(enum.Enum):
    """How bulk streams to a peer travel."""

    DATA_PLANE = "data-plane"  # a TLS connection of our own beside libp2p, pinned over libp2p
    DIRECT = "direct"  # a libp2p stream on a direct connection
    RELAYED = "relayed"  # a libp2p stream through a circuit relay
    MEMORY = "memory"  # the in-memory twin


@dataclass(frozen=True)
class LinkInfo:
    path: LinkPath
    reason: str = ""  # why this path and not a faster one


class Network(Protocol):
    gate: PeerGate  # the allowlist, rates and penalties this endpoint enforces
    guard: StreamGuard  # runs served streams under the gate

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the endpoint until cancelled; `task_status.started(self)` once peers can reach it."""
        ...

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

    def bound_addresses(self) -> list[str]:
        """Where this endpoint listens, ports as bound (what `swarmd join` prints)."""
        ...

    async def open_stream(self, peer_id: str, protocol: str, *, bulk: bool = False) -> Stream:
        """A new stream speaking `protocol`, dialing first if needed; raise PeerUnreachable. A `bulk` stream
        (activations) may travel on a faster path than the connection's own streams, and may be `detachable`."""
        ...

    def serve(self, protocol: str, handler: StreamHandler, *, bulk: bool = False) -> None:
        """Run `handler` for every inbound stream of `protocol` (with `bulk`, also those on the fast path).
        Its exceptions are logged, never fatal."""
        ...

    def link_paths(self) -> dict[str, LinkInfo]:
        """Per peer with bulk streams: the path they take and why."""
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
