"""The actor transport over a py-libp2p host: streams on `/swarmd/act/1.0.0`, optionally upgraded to TLS.

`P2PLinks(host)` is both sides of it: `open(peer)` is the transport's opener (dial, negotiate a stream,
exchange `Hello`, move to the TLS data plane when configured and offered), and `start(transport, nursery)`
installs the stream handler that answers `Hello` and serves the stream with the transport:

    transport, links = await start_actor_transport(host, nursery, config, plane=Plane.TLS)

which is short for

    links = P2PLinks(host, plane=Plane.TLS)
    transport = ActorTransport(links.open, config, local_peer=str(host.get_id()), on_penalise=links.disconnect)
    await nursery.start(transport.run)
    await links.start(transport, nursery)
 Follows the field notes on
py-libp2p 0.8.1: a handler never lets an exception escape (it would take the host down), the 60 s dial
blacklist is lifted before every dial (this is a retry), and EOF is a plain end of stream.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from swarmd.errors import LocalProtocolError
from swarmd.net.tls_plane import DataPlane, DataPlaneConfig
from swarmd.transport.transport import (
    PROTOCOL,
    ActorTransport,
    ByteStream,
    LinkError,
    TransportConfig,
    close_quietly,
    read_frame,
)
from swarmd.wire.messages import Hello, encode

log = logging.getLogger(__name__)

HELLO_LIMIT = 4096
HELLO_TIMEOUT = 10.0


class Plane(enum.Enum):
    """Where activations travel: on the libp2p stream itself, or on the pinned TLS data plane (the default:
    py-libp2p alone costs over 1 ms per hop, see docs/BENCHMARKS.md; libp2p stays the fallback)."""

    LIBP2P = "libp2p"
    TLS = "tls"


class Libp2pStream:
    """A py-libp2p stream as a `ByteStream`: EOF becomes b''; other stream errors propagate."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def read(self, max_bytes: int) -> bytes:
        try:
            return await self.stream.read(max_bytes)
        except EOFError:  # libp2p's StreamEOF is an EOFError
            return b""

    async def write(self, data: bytes) -> None:
        await self.stream.write(data)

    async def close(self) -> None:
        await self.stream.close()


class P2PLinks:
    """Opens and serves actor links on a libp2p host. Create it, give `open` to the ActorTransport, `start`."""

    def __init__(self, host: Any, *, plane: Plane = Plane.TLS, data_plane: DataPlaneConfig | None = None) -> None:
        self.host = host
        self.plane = plane
        self.data_plane_config = data_plane or DataPlaneConfig()
        self.data_plane: DataPlane | None = None
        self._transport: ActorTransport | None = None
        self.tls_fallbacks = 0  # links that wanted TLS and stayed on libp2p
        self.paths: dict[str, tuple[str, str]] = {}  # peer -> ("data-plane" | "libp2p", why) of our link to it
        # set by the daemon (swarmd.net.connectivity): dial a peer first where libp2p would not (relays), and
        # offer the data plane only to peers whose dial can arrive (not through a NAT that drops it)
        self.ensure_connected: Callable[[str], Awaitable[None]] | None = None
        self.may_offer: Callable[[str, Any], tuple[bool, str]] | None = None

    @property
    def transport(self) -> ActorTransport:
        if self._transport is None:
            raise LocalProtocolError("P2PLinks.start has not run")
        return self._transport

    async def start(self, transport: ActorTransport, nursery: trio.Nursery) -> None:
        """Serve `/swarmd/act/1.0.0` with `transport`; with the TLS plane, start the data-plane listener."""
        self._transport = transport
        if self.plane is Plane.TLS:
            self.data_plane = DataPlane(transport, str(self.host.get_id()), self.data_plane_config)
            await nursery.start(self.data_plane.run)
        self.host.set_stream_handler(PROTOCOL, self._handle)

    async def open(self, peer: str) -> ByteStream:
        """The transport's opener: a ready link to `peer`, on TLS when configured and offered."""
        from libp2p.peer.id import ID

        peer_id = ID.from_base58(peer)
        # The first failed dial puts a peer on a 60 s blacklist; every open after that is a deliberate retry.
        self.host.get_network().unblock_peer(peer_id)
        try:
            if self.ensure_connected is not None:
                await self.ensure_connected(peer)
            raw = await self.host.new_stream(peer_id, [PROTOCOL])
        except Exception as e:
            raise LinkError(f"cannot open {PROTOCOL} to {peer[:16]}: {type(e).__name__}: {e}") from e
        stream = Libp2pStream(raw)
        try:
            with trio.fail_after(HELLO_TIMEOUT):
                await stream.write(encode(Hello(self.transport.config.max_frame, want_tls=self.plane is Plane.TLS)))
                answer = await read_frame(stream, HELLO_LIMIT)
            if not isinstance(answer.msg, Hello):
                raise LinkError(f"{peer[:16]} answered hello with {answer.msg.TAG}")
            hello = answer.msg
            if self.plane is Plane.TLS and hello.tls_token and self.data_plane is not None:
                try:
                    tls = await self.data_plane.dial(hello, fallback_host=_remote_host(raw))
                except Exception as e:
                    self.tls_fallbacks += 1
                    log.warning("TLS data plane to %s failed (%s: %s); staying on libp2p", peer[:16],
                                type(e).__name__, e)
                    self.paths[peer] = ("libp2p", f"its data plane did not answer ({type(e).__name__}: {e})"[:200])
                else:
                    await close_quietly(stream)
                    self.paths[peer] = ("data-plane", f"{hello.tls_host or _remote_host(raw)}:{hello.tls_port}")
                    return tls
            else:
                self.paths[peer] = ("libp2p", "libp2p streams only (--data-plane libp2p)" if self.plane is Plane.LIBP2P
                                    else "it did not offer its data plane to this daemon")
            return stream
        except BaseException:
            await close_quietly(stream)
            raise

    async def disconnect(self, peer: str) -> None:
        """Drop every connection with `peer`: libp2p and data plane (the transport's `on_penalise`). On a
        daemon's host the peer gate penalises it too, so it is refused everywhere, not only on this protocol."""
        from libp2p.peer.id import ID

        from swarmd.net.libp2p_gate import gate_of

        gate = gate_of(self.host)
        if gate is not None and not gate.is_penalised(peer, trio.current_time()):
            gate.penalise(peer, trio.current_time(), "cut off by the actor transport (bad frames)")
        if self.data_plane is not None:
            await self.data_plane.drop(peer)
        await self.host.disconnect(ID.from_base58(peer))

    async def _handle(self, raw: Any) -> None:
        # A py-libp2p stream handler must never raise: an escaping exception ends the whole host.
        stream = Libp2pStream(raw)
        try:
            peer = str(raw.muxed_conn.peer_id)
            if self.transport.penalised(peer):
                return
            with trio.fail_after(HELLO_TIMEOUT):
                env = await read_frame(stream, HELLO_LIMIT)
                if not isinstance(env.msg, Hello):
                    log.info("%s opened a link without hello", peer[:16])
                    return
                offer_tls = env.msg.want_tls and self.data_plane is not None and self.data_plane.port
                if offer_tls and self.may_offer is not None:
                    offer_tls = self.may_offer(peer, raw)[0]
                max_frame = self.transport.config.max_frame
                answer = self.data_plane.offer(peer, max_frame) if offer_tls and self.data_plane else Hello(max_frame)
                await stream.write(encode(answer))
            await self.transport.serve(peer, stream)
        except Exception as e:
            log.info("inbound %s stream ended: %s: %s", PROTOCOL, type(e).__name__, e)
        finally:
            await close_quietly(stream)


async def start_actor_transport(
    host: Any,
    nursery: trio.Nursery,
    config: TransportConfig | None = None,
    *,
    plane: Plane = Plane.TLS,
    data_plane: DataPlaneConfig | None = None,
    on_undeliverable: Callable[[str, Any, str], None] | None = None,
) -> tuple[ActorTransport, P2PLinks]:
    """An ActorTransport serving and dialing `/swarmd/act/1.0.0` on a running libp2p host, its tasks in `nursery`."""
    links = P2PLinks(host, plane=plane, data_plane=data_plane)
    transport = ActorTransport(links.open, config, local_peer=str(host.get_id()), on_penalise=links.disconnect,
                               on_undeliverable=on_undeliverable)
    await nursery.start(transport.run)
    await links.start(transport, nursery)
    return transport, links


def _remote_host(raw: Any) -> str:
    """The address we reached the peer at over libp2p: where its data plane listens unless it says otherwise."""
    try:
        address = raw.get_remote_address()
    except Exception:
        return ""
    return str(address[0]) if address else ""
