"""The libp2p side of the network seam: one py-libp2p host (TCP, noise, yamux) plus gossipsub.

Settings come from the measured notes on py-libp2p 0.8.1:
- `max_connections_per_peer=1`: otherwise every connect() waits a fixed 250 ms;
- gossipsub heartbeat 1 s with adaptive gossip off (it stretches to 30 s) and spam protection
  off (it drops more than 10 messages/s per neighbour);
- an exception escaping a stream handler tears the whole host down: every handler is wrapped;
- a failed dial blacklists the peer for 60 s: `unblock_peer` before every dial;
- `read(n)` is a short read: framing lives in `swarmd.net.seam`.
The host serves identify and ping (libp2p's defaults), so other libp2p implementations can talk to it.

Bulk streams (the actor transport's) move to the TLS data plane (`swarmd.net.tls_plane`) when both ends run
one; `link_paths()` says per peer which path they took and why.

Across real networks (`swarmd.net.connectivity`): the addresses told to peers (here and in identify) are real
ones, reachability is checked by dial-back, peers behind NAT are dialled through circuit relays (which
py-libp2p's own dialling skips), hole punching moves relayed links to direct connections, and the data plane is
offered only to peers whose dial can arrive.

A private swarm (`swarm_key`) uses py-libp2p's private network: every TCP connection is wrapped in a stream
cipher keyed by the swarm key before multistream-select and noise, so a peer without the key cannot finish
a handshake, let alone open a stream or read gossip (docs/SECURITY.md). The peer gate (`swarmd.net.gate`)
applies the allowlist and penalties right after the security handshake and to every stream and gossip
message; see `swarmd.net.libp2p_gate`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import trio

from swarmd.config import LAN, Timings
from swarmd.errors import UserError
from swarmd.net.gate import GuardLimits, PeerGate
from swarmd.net.identity import short_id
from swarmd.net.libp2p_gate import gossip_validator, guard_all_handlers, install_gate
from swarmd.net.seam import GossipMessage, LinkInfo, LinkPath, PeerUnreachable, Stream, StreamHandler
from swarmd.net.stream_guard import StreamGuard
from swarmd.net.streams import Libp2pStream, close_quietly, read_frame, write_frame
from swarmd.net.tls_plane import MAX_HANDSHAKE_FRAME, PLANE_PROTOCOL, DataPlane, DataPlaneConfig, Offer
from swarmd.tasks import spawn

if TYPE_CHECKING:
    from libp2p.abc import INotifee

    from swarmd.net.connectivity import Connectivity, ConnectivityConfig
    from swarmd.net.swarm_key import SwarmKey

log = logging.getLogger(__name__)

GOSSIP_DEGREE = (6, 4, 12)  # D, D_lo, D_hi
HANG_UP_DELAY = 0.25  # lets a cut-off peer read why before its connections go (a reset drops unread data)
GOSSIP_MEND_INTERVAL = 1.0  # s between looks for gossip streams left on closed connections
MAX_GOSSIP_BYTES = 1 << 20  # gossipsub's own inbound limit
# Transports py-libp2p's private network does not wrap (QUIC and the like bring their own handshake).
UNPROTECTED = {"quic", "quic-v1", "webtransport", "webrtc", "webrtc-direct", "ws", "wss", "tls"}


def parse_multiaddr(text: str, what: str, *, need_peer_id: bool = False):
    """A Multiaddr, or a UserError that names the option and the problem in one line."""
    import multiaddr

    try:
        ma = multiaddr.Multiaddr(text)
    except Exception as e:
        raise UserError(f"{what} {text!r} is not a multiaddr: {str(e).split(' (string:')[0]}") from None
    if need_peer_id and "p2p" not in [p.name for p in ma.protocols()]:
        raise UserError(f"{what} {text!r} must end in /p2p/<peer id> (the line 'Swarm listening on ...' shows it)")
    return ma


def split_peer_addr(text: str, what: str = "address") -> tuple[str, str]:
    """'/ip4/../tcp/P/p2p/ID' -> (ID, '/ip4/../tcp/P')."""
    from libp2p.peer.peerinfo import info_from_p2p_addr

    ma = parse_multiaddr(text, what, need_peer_id=True)
    try:
        info = info_from_p2p_addr(ma)
    except Exception as e:
        raise UserError(f"{what} {text!r}: {e}") from None
    return info.peer_id.to_base58(), str(info.addrs[0]) if info.addrs else ""


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _expand_unspecified(addr: str) -> list[str]:
    """/ip4/0.0.0.0/tcp/P -> one address per local interface (what peers can actually dial)."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[2] not in ("0.0.0.0", "::"):
        return [addr]
    import psutil

    family = "ip4" if parts[2] == "0.0.0.0" else "ip6"
    out = []
    for entries in psutil.net_if_addrs().values():
        for e in entries:
            try:
                ip = ipaddress.ip_address(e.address.split("%")[0])
            except ValueError:
                continue
            if (ip.version == 4) == (family == "ip4") and not ip.is_link_local:
                out.append("/".join([parts[0], parts[1], str(ip), *parts[3:]]))
    return sorted(out, key=lambda a: ("127.0.0.1" in a or "/::1/" in a, a)) or [addr]


class _DisconnectNotifee:
    """Tells the network when the last connection to a peer closed."""

    def __init__(self, net: Libp2pNetwork) -> None:
        self.net = net

    async def connected(self, network, conn) -> None:
        return None

    async def disconnected(self, network, conn) -> None:
        peer = conn.muxed_conn.peer_id
        if not network.connections.get(peer):
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                self.net._disconnect_send.send_nowait(peer.to_base58())

    async def opened_stream(self, network, stream) -> None:
        return None

    async def closed_stream(self, network, stream) -> None:
        return None

    async def listen(self, network, multiaddr) -> None:
        return None

    async def listen_close(self, network, multiaddr) -> None:
        return None


class Libp2pNetwork:
    """`swarmd.net.seam.Network` over a py-libp2p host. Start it with `await nursery.start(net.run)`."""

    def __init__(self, key_pair, listen: Sequence[str], announce: Sequence[str] = (), *,
                 timings: Timings = LAN, mdns: bool = False, swarm_key: SwarmKey | None = None,
                 allow: frozenset[str] | None = None, limits: GuardLimits | None = None,
                 data_plane: DataPlaneConfig | None = None, connectivity: ConnectivityConfig | None = None) -> None:
        from swarmd.net.identity import peer_id_of

        self._key_pair = key_pair
        self._peer_id = peer_id_of(key_pair)
        self._listen = [parse_multiaddr(a, "--listen") for a in listen]
        self.swarm_key = swarm_key
        if swarm_key is not None:
            for ma in self._listen:
                bad = UNPROTECTED & {p.name for p in ma.protocols()}
                if bad:
                    raise UserError(f"--listen {ma}: a private swarm listens on TCP only (py-libp2p's private "
                                    f"network does not wrap {', '.join(sorted(bad))})")
        self.gate = PeerGate(allow, limits, self_id=self._peer_id, on_penalised=self._on_penalised)
        self.guard = StreamGuard(self.gate)
        self._announce = [parse_multiaddr(a, "--announce") for a in announce]
        self._timings = timings
        self._mdns = mdns
        self._disconnect_send, self._disconnect_recv = trio.open_memory_channel[str](256)
        self._discovered_send, self._discovered_recv = trio.open_memory_channel[tuple[str, list[str]]](256)
        self.host: Any = None  # libp2p's IHost, once run() has started
        self._gated: Any = None
        self.pubsub: Any = None
        self._nursery: trio.Nursery | None = None
        self._plane_config = data_plane  # None: bulk streams stay on libp2p
        self.data_plane: DataPlane | None = None
        self._bulk_handlers: dict[str, StreamHandler] = {}
        self._paths: dict[str, LinkInfo] = {}
        self._connectivity_config = connectivity
        self.connectivity: Connectivity | None = None  # addresses, reachability, relays, hole punching

    # --- lifecycle ------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from libp2p import new_host
        from libp2p.network.config import ConnectionConfig, RetryConfig
        from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
        from libp2p.pubsub.pubsub import Pubsub
        from libp2p.tools.anyio_service import background_trio_service

        from swarmd.net.connectivity import Connectivity, ConnectivityConfig

        t = self._timings
        host = new_host(
            key_pair=self._key_pair,
            listen_addrs=self._listen,
            connection_config=ConnectionConfig(max_connections_per_peer=1, dial_timeout=t.dial_timeout,
                                               inbound_upgrade_timeout=max(t.dial_timeout, 2.0)),
            enable_mDNS=self._mdns,
            psk=self.swarm_key.hex if self.swarm_key is not None else None,
        )
        # py-libp2p retries a failed dial 3 times after 0.1, 0.2 and 0.4 s: a dead peer's refusal then takes a
        # second or more per address, longer than a probe waits, and membership could not tell it from a hung
        # peer. The same 3 retries, closer together, refuse within a few hundred ms (swarmd's own dial loop
        # and transport back off between dials).
        host.get_network().retry_config = RetryConfig(max_retries=3, initial_delay=0.02, max_delay=0.1)
        self._gated = install_gate(host, self.gate)
        guard_all_handlers(host, self.gate)  # before gossipsub registers its handlers
        d, d_lo, d_hi = GOSSIP_DEGREE
        gossipsub = GossipSub(protocols=[PROTOCOL_ID_V11, PROTOCOL_ID], degree=d, degree_low=d_lo, degree_high=d_hi,
                              heartbeat_interval=1, adaptive_gossip_enabled=False, spam_protection_enabled=False)
        pubsub = Pubsub(host, gossipsub)
        self.host, self.pubsub = host, pubsub
        self.connectivity = Connectivity(
            host, self._peer_id, listen=[str(a) for a in self._listen], announce=[str(a) for a in self._announce],
            config=self._connectivity_config or ConnectivityConfig(), dial_timeout=t.dial_timeout, serve=self.serve,
            psk=self.swarm_key.hex if self.swarm_key is not None else None)
        self.connectivity.plane_out = self._paths.get
        self.connectivity.plane_in = lambda peer: self.data_plane.connections(peer) if self.data_plane else 0
        self.connectivity.data_plane_port = lambda: self.data_plane.port if self.data_plane else 0
        host._addrs_factory = self.connectivity.addrs_factory  # type: ignore[attr-defined] # told by identify, relays
        async with host.run(listen_addrs=self._listen), trio.open_nursery() as nursery:
            if not host.get_network().listeners:
                wanted = ", ".join(str(a) for a in self._listen)
                raise UserError(f"could not listen on {wanted}: the port is in use or the address is not local")
            async with background_trio_service(pubsub), background_trio_service(gossipsub):
                await pubsub.wait_until_ready()
                host.get_network().register_notifee(cast("INotifee", _DisconnectNotifee(self)))
                self._nursery = nursery
                nursery.start_soon(self._release_penalties)
                nursery.start_soon(self._mend_gossip_streams)
                await nursery.start(self.connectivity.run)
                if self._plane_config is not None:
                    await self._start_data_plane(nursery, self._plane_config)
                if self._mdns:
                    self._watch_mdns()
                task_status.started(self)
                try:
                    await trio.sleep_forever()
                finally:
                    nursery.cancel_scope.cancel()

    # --- Network ----------------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def connections_refused(self) -> int:
        """Connections hung up on right after the security handshake (allowlist, penalties)."""
        return self._gated.refused if self._gated is not None else 0

    def bound_addresses(self) -> list[str]:
        """The addresses we listen on, ports as bound, each ending in /p2p/<id>."""
        return [f"{a}/p2p/{self._peer_id}" for a in self.host.get_transport_addrs()]

    def addresses(self) -> list[str]:
        if self.connectivity is not None:
            return self.connectivity.advertised()
        if self._announce:
            return [f"{a}/p2p/{self._peer_id}" if "/p2p/" not in str(a) else str(a) for a in self._announce]
        out: list[str] = []
        for a in self.host.get_transport_addrs():
            out += [f"{x}/p2p/{self._peer_id}" for x in _expand_unspecified(str(a))]
        return out

    async def publish(self, topic: str, data: bytes) -> None:
        await self.pubsub.publish(topic, data)

    async def subscribe(self, topic: str) -> trio.MemoryReceiveChannel[GossipMessage]:
        from libp2p.peer.id import ID

        # Checked before gossipsub delivers or forwards a message: its origin is admitted and within its rate.
        self.pubsub.set_topic_validator(topic, gossip_validator(self.gate, self._peer_id, MAX_GOSSIP_BYTES), False)
        sub = await self.pubsub.subscribe(topic)
        send, recv = trio.open_memory_channel[GossipMessage](1024)

        async def forward() -> None:
            dropped = 0
            while True:
                msg = await sub.get()
                origin = ID(msg.from_id).to_base58()
                if origin == self._peer_id or not self.gate.admits(origin, trio.current_time()):
                    continue
                try:
                    send.send_nowait(GossipMessage(origin, msg.data))
                except trio.WouldBlock:
                    dropped += 1
                    if dropped in (1, 100, 10000):
                        log.warning("gossip reader is behind: dropped %d messages on %s", dropped, topic)

        assert self._nursery is not None
        self._nursery.start_soon(forward)
        return recv

    async def connect(self, peer_id: str, addresses: Sequence[str]) -> None:
        from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

        pid = self._id(peer_id)
        if self.connectivity is not None:  # direct addresses worth a dial, then through relays
            await self.connectivity.connect(peer_id, addresses)
            return
        addrs = []
        for a in addresses:
            try:
                info = info_from_p2p_addr(parse_multiaddr(a, "address", need_peer_id=True))
            except UserError:
                continue
            if info.peer_id == pid:
                addrs += info.addrs
        self.host.get_network().unblock_peer(pid)  # a failed dial blocks the peer for 60 s otherwise
        try:
            with trio.fail_after(self._timings.dial_timeout):
                await self.host.connect(PeerInfo(pid, addrs))
        except trio.TooSlowError:
            raise PeerUnreachable(f"no answer within {self._timings.dial_timeout:g} s") from None
        except Exception as e:
            raise PeerUnreachable(_dial_error(e)) from None

    def is_connected(self, peer_id: str) -> bool:
        return bool(self.host.get_network().connections.get(self._id(peer_id)))

    def connected_peers(self) -> list[str]:
        return [p.to_base58() for p, conns in self.host.get_network().connections.items() if conns]

    def is_relayed(self, peer_id: str) -> bool:
        return any(_through_relay(c) for c in self.host.get_network().connections.get(self._id(peer_id), ()))

    async def open_stream(self, peer_id: str, protocol: str, *, bulk: bool = False) -> Stream:
        if bulk and self.data_plane is not None:
            stream = await self._open_on_data_plane(peer_id, protocol)
            if stream is not None:
                return stream
        elif bulk:
            self._paths[peer_id] = LinkInfo(LinkPath.DIRECT, "the data plane is off (--data-plane libp2p)")
        return Libp2pStream(await self._new_stream(peer_id, protocol))

    async def _new_stream(self, peer_id: str, protocol: str) -> Any:
        pid = self._id(peer_id)
        if not self.is_connected(peer_id):
            self.host.get_network().unblock_peer(pid)
        try:
            with trio.fail_after(self._timings.dial_timeout):
                if self.connectivity is not None:  # py-libp2p would not dial a peer's relay addresses
                    await self.connectivity.ensure_connected(peer_id)
                return await self.host.new_stream(pid, [protocol])
        except trio.TooSlowError:
            raise PeerUnreachable(f"opening {protocol} took over {self._timings.dial_timeout:g} s") from None
        except Exception as e:
            raise PeerUnreachable(_dial_error(e)) from None

    def serve(self, protocol: str, handler: StreamHandler, *, bulk: bool = False) -> None:
        """Serve `protocol` under the stream guard: refused peers, rates, strikes, and (for streams that are not
        `bulk`, which carry their own liveness checks) read timeouts and a cap on open streams per peer."""
        guarded = self.guard.wrap(protocol, handler, long_lived=bulk)
        if bulk:
            self._bulk_handlers[protocol] = guarded

        async def adapter(stream) -> None:
            wrapped = Libp2pStream(stream)
            try:
                await guarded(wrapped.remote_peer, wrapped)
            finally:
                await close_quietly(wrapped)

        self.host.set_stream_handler(protocol, adapter)

    def link_paths(self) -> dict[str, LinkInfo]:
        if self.connectivity is not None:  # what the connections are (a relayed one, a hole-punched one) as well
            return self.connectivity.link_paths()
        return dict(self._paths)

    # --- the data plane ----------------------------------------------------------------------
    async def _start_data_plane(self, nursery: trio.Nursery, config: DataPlaneConfig) -> None:
        """Listen where libp2p listens, announce what --announce says, and offer it on PLANE_PROTOCOL."""
        from dataclasses import replace

        from swarmd.net.connectivity import data_plane_config

        where = data_plane_config([str(a) for a in self._listen], [str(a) for a in self._announce])
        config = replace(config, bind_host=config.bind_host or where.bind_host,
                         announce_host=config.announce_host or where.announce_host)
        self.data_plane = DataPlane(self._peer_id, self._accept_bulk, config)
        await nursery.start(self.data_plane.run)
        self.serve(PLANE_PROTOCOL, self._offer_data_plane)

    async def _offer_data_plane(self, peer: str, stream: Stream) -> None:
        protocol = (await read_frame(stream, MAX_HANDSHAKE_FRAME)).decode(errors="replace")
        offer = self.data_plane.offer(peer, protocol) if self.data_plane and protocol in self._bulk_handlers else None
        if offer is not None and self.connectivity is not None and \
                not self.connectivity.may_offer_data_plane(peer, stream)[0]:
            offer = None  # its dial could not arrive (it reaches us through a relay, or we are behind NAT)
        await write_frame(stream, offer.encode() if offer is not None else b"")

    async def _accept_bulk(self, peer: str, protocol: str, stream: Stream) -> None:
        handler = self._bulk_handlers.get(protocol)
        if handler is not None:
            await handler(peer, stream)

    async def _open_on_data_plane(self, peer_id: str, protocol: str) -> Stream | None:
        """A bulk stream on the peer's data plane, or None (the reason kept for `link_paths`)."""
        assert self.data_plane is not None
        try:
            raw = await self._new_stream(peer_id, PLANE_PROTOCOL)
        except PeerUnreachable as e:
            if not self.is_connected(peer_id):
                raise
            self._paths[peer_id] = LinkInfo(LinkPath.DIRECT, f"the peer offers no data plane ({e})")
            return None
        plane = Libp2pStream(raw)
        try:
            with trio.fail_after(self.data_plane.config.handshake_timeout):
                await write_frame(plane, protocol.encode())
                answer = await read_frame(plane, MAX_HANDSHAKE_FRAME)
            if not answer:
                self._paths[peer_id] = LinkInfo(LinkPath.DIRECT, "the peer offers no data plane for " + protocol)
                return None
            offer = Offer.decode(answer)
            where = f"{offer.host or plane.remote_address()}:{offer.port}"
            stream = await self.data_plane.dial(offer, fallback_host=plane.remote_address())
        except Exception as e:
            reason = f"the data plane failed ({one_line(e)}): staying on libp2p"
            log.warning("%s to %s: %s", protocol, short_id(peer_id), reason)
            self._paths[peer_id] = LinkInfo(LinkPath.DIRECT, reason)
            return None
        finally:
            await close_quietly(plane)
        self._paths[peer_id] = LinkInfo(LinkPath.DATA_PLANE, f"both ends run one; its listens at {where}")
        return stream

    def strike(self, peer_id: str, reason: str) -> None:
        """`peer_id` sent something that failed its checks (enough strikes and it is cut off)."""
        self.gate.strike(peer_id, trio.current_time(), reason)

    def disconnects(self) -> trio.MemoryReceiveChannel[str]:
        return self._disconnect_recv

    def hang_up(self, peer_id: str) -> None:
        spawn(self._nursery, self._disconnect, peer_id)

    def discovered(self) -> trio.MemoryReceiveChannel[tuple[str, list[str]]]:
        """Peers found by mDNS (only with --mdns): (peer id, addresses)."""
        return self._discovered_recv

    # --- penalties ------------------------------------------------------------------------
    def _on_penalised(self, peer_id: str, reason: str) -> None:
        """The gate cut `peer_id` off: drop its gossip and its connections (reconnects are refused)."""
        if peer_id.startswith("ip:"):  # an address opening connections too fast: refused before handshakes
            log.warning("refusing connections from %s for %.0f s: %s", peer_id[3:], self.gate.limits.penalty, reason)
            return
        log.warning("cutting off %s for %.0f s: %s", short_id(peer_id), self.gate.limits.penalty, reason)
        if self.pubsub is not None:
            with contextlib.suppress(Exception):
                self.pubsub.add_to_blacklist(self._id(peer_id))
        spawn(self._nursery, self._disconnect, peer_id, HANG_UP_DELAY)

    async def _disconnect(self, peer_id: str, delay: float = 0.0) -> None:
        await trio.sleep(delay)
        if self.data_plane is not None:
            await self.data_plane.drop(peer_id)
        with trio.move_on_after(5.0):
            try:
                await self.host.disconnect(self._id(peer_id))
            except Exception as e:
                log.debug("disconnecting %s: %s", short_id(peer_id), one_line(e))

    async def _mend_gossip_streams(self) -> None:
        """Give gossip a new stream to every peer whose stream was left on a closed connection."""
        while True:
            await trio.sleep(GOSSIP_MEND_INTERVAL)
            if self.pubsub is None:
                continue
            for peer in gossip_streams_on_closed_connections(self.pubsub.peers, self.host.get_network()):
                log.info("gossip stream to %s was left on a closed connection: opening a new one",
                         short_id(peer.to_base58()))
                # py-libp2p's own repair: it forgets the stream and, the peer being connected, opens another
                self.pubsub._handle_dead_peer(peer)

    async def _release_penalties(self) -> None:
        while True:
            await trio.sleep(1.0)
            for peer_id in self.gate.expire(trio.current_time()):
                log.info("penalty of %s is over", short_id(peer_id))
                with contextlib.suppress(Exception):
                    self.pubsub.remove_from_blacklist(self._id(peer_id))

    # --- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _id(peer_id: str):
        from libp2p.peer.id import ID

        try:
            return ID.from_base58(peer_id)
        except Exception:
            raise PeerUnreachable(f"{peer_id!r} is not a peer id") from None

    def _watch_mdns(self) -> None:
        """Stock mDNS only fills the peerstore; forward what it finds so the swarm dials it."""
        from libp2p.discovery.events.peerDiscovery import peerDiscovery

        token = trio.lowlevel.current_trio_token()

        def found(info) -> None:  # runs in zeroconf's thread
            item = (info.peer_id.to_base58(), [f"{a}/p2p/{info.peer_id}" for a in info.addrs])
            with contextlib.suppress(Exception):
                trio.from_thread.run_sync(self._discovered_send.send_nowait, item, trio_token=token)

        peerDiscovery.register_peer_discovered_handler(found)


def gossip_streams_on_closed_connections(pubsub_peers: dict[Any, Any], network: Any) -> list[Any]:
    """Peers whose pubsub stream sits on a connection that has closed while another connection to them is
    open. py-libp2p keeps such a stream when the new connection came up before it handled the old one's
    close (a reset link redialled at once), and from then on no gossip reaches that peer."""
    def closed(conn: Any) -> bool:
        muxed = getattr(conn, "muxed_conn", conn)
        return bool(getattr(muxed, "is_closed", False))

    return [peer for peer, stream in list(pubsub_peers.items())
            if closed(getattr(stream, "muxed_conn", None))
            and any(not closed(c) for c in network.get_connections(peer))]


def _through_relay(conn: Any) -> bool:
    """Whether a libp2p connection runs over a circuit relay: its addresses name /p2p-circuit, or its raw
    connection is the relay transport's."""
    from libp2p.relay.circuit_v2.transport import TrackedRawConnection

    with contextlib.suppress(Exception):
        if any("p2p-circuit" in str(a) for a in conn.get_transport_addresses()):
            return True
    # swarm connection -> muxer -> secure session -> message reader -> raw connection
    todo, seen = [conn], 0
    while todo and seen < 16:
        layer = todo.pop()
        seen += 1
        if isinstance(layer, TrackedRawConnection):
            return True
        todo += [x for a in ("muxed_conn", "secured_conn", "conn", "read_writer", "read_write_closer")
                 if (x := getattr(layer, a, None)) is not None and x is not layer]
    return False


def _host_of(ma: Any) -> str:
    """The IP address of a multiaddr ('' when it has none)."""
    for proto in ("ip4", "ip6"):
        try:
            return str(ma.value_for_protocol(proto))
        except Exception:
            continue
    return ""


def _dial_error(e: BaseException) -> str:
    """The most telling line of a dial failure (libp2p nests the real cause)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    cause = e
    for _ in range(5):
        nxt = cause.__cause__ or cause.__context__
        if nxt is None:
            break
        cause = nxt
    if cause is not e and str(cause):
        return f"{one_line(e)} ({one_line(cause)})"
    return one_line(e)
