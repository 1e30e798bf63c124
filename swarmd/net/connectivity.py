"""A daemon's reach across real networks: addresses, reachability, relays, hole punching, link paths.

`Connectivity` runs beside the libp2p host (`Libp2pNetwork` starts it) and ties the pieces together:

- reachability: every `reach_interval` (every `reach_retry` while unknown), up to three peers it has a direct
  connection to dial it back on new connections (`swarmd.net.reachability`);
- addresses: what the daemon advertises, in its descriptor and in libp2p's identify
  (`swarmd.net.addresses.advertised`): no wildcard, no LAN address once seen from outside, circuit addresses
  while unreachable;
- relays: it serves relaying unless told not to, and while unreachable keeps reservations on members that
  serve it (or the `--relay` ones) (`swarmd.net.relay`);
- dialling: direct addresses worth trying first, then through a relay, explicitly (`connect`);
- hole punching with members reached only through a relay, and moving links off the relay once it worked
  (`swarmd.net.hole_punch`);
- whether to offer the TLS data plane to a peer, and which path each peer's link takes (`links`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from swarmd.net.addresses import (
    Scope,
    advertised,
    dialable,
    interface_ips,
    ip_of,
    is_circuit,
    local_networks,
    on_link,
    scope_of,
    strip_peer,
    tcp_address,
    tcp_port_of,
    with_peer,
)
from swarmd.net.hole_punch import HolePuncher
from swarmd.net.identity import short_id
from swarmd.net.link_paths import (
    LinkFacts,
    connection_kinds,
    describe,
    kinds_for_descriptor,
    relay_of_connection,
)
from swarmd.net.reachability import (
    PROTOCOL,
    UNKNOWN,
    ReachServer,
    Report,
    Request,
    Verdict,
    ask,
    libp2p_dial_back,
    local_port_of,
    remote_of,
    tcp_probe,
    verdict,
)
from swarmd.net.relay import RelayClient, RelayLimits
from swarmd.net.seam import LinkInfo, LinkPath, PeerUnreachable
from swarmd.net.streams import Libp2pStream
from swarmd.tasks import spawn

log = logging.getLogger("swarmd.connectivity")

MAX_REPORTS = 8
ASK_AT_ONCE = 3


@dataclass(frozen=True)
class ConnectivityConfig:
    relay_service: bool = True  # serve circuit relay v2 for the swarm (when reachable it is useful to others)
    relays: tuple[str, ...] = ()  # relays to reserve on besides members, /…/p2p/<relay id>
    relay_limits: RelayLimits = field(default_factory=RelayLimits)
    hole_punching: bool = True
    max_reservations: int = 2
    reach_interval: float = 300.0  # re-check reachability this often
    reach_retry: float = 3.0  # while the verdict is unknown, or a new peer can tell
    reach_timeout: float = 3.0  # for each dial-back
    reservation_retry: float = 10.0  # a relay that refused is asked again after this long


class Connectivity:
    def __init__(self, host: Any, peer_id: str, *, listen: Sequence[str], announce: Sequence[str] = (),
                 config: ConnectivityConfig | None = None, dial_timeout: float = 5.0,
                 serve: Callable[[str, Any], None] | None = None, psk: str | None = None) -> None:
        self.host, self.peer_id = host, peer_id
        self.config = config or ConnectivityConfig()
        self.listen = tuple(listen)
        self.announce = tuple(announce)
        self.dial_timeout = dial_timeout
        self._serve = serve
        self.verdict: Verdict = UNKNOWN
        self.reports: dict[str, Report] = {}
        self.server = ReachServer(libp2p_dial_back(host), tcp_probe, self.config.reach_timeout)
        self.relay = RelayClient(host, peer_id, serve=self.config.relay_service, limits=self.config.relay_limits,
                                 psk=psk)
        self.puncher = HolePuncher(host, peer_id, predicted=self._predicted, on_direct=self._moved_direct) \
            if self.config.hole_punching else None
        # the network's data plane (Libp2pNetwork sets these): its port, and per peer the path our bulk streams
        # took and how many of its data-plane connections we hold
        self.data_plane_port: Callable[[], int] = lambda: 0
        self.plane_out: Callable[[str], LinkInfo | None] = lambda peer: None
        self.plane_in: Callable[[str], int] = lambda peer: 0
        # the swarm's members and the addresses their descriptors advertise (set by the node)
        self.members: Callable[[], dict[str, tuple[str, ...]]] = dict
        self.known: dict[str, tuple[str, ...]] = {}  # addresses a peer was dialled at
        self.dial_errors: dict[str, str] = {}
        self.offers: dict[str, str] = {}  # peer -> why our data plane was not offered to it
        self._refused_at: dict[str, float] = {}
        self._asked_at: dict[str, float] = {}
        self._networks = local_networks()
        self._own_ips = interface_ips()
        self._nursery: trio.Nursery | None = None

    # --- lifecycle ------------------------------------------------------------------------------------------------
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self._serve is not None:
            self._serve(PROTOCOL, self._serve_reach)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.relay.run)
            if self.puncher is not None:
                await nursery.start(self.puncher.run)
            nursery.start_soon(self._check_loop)
            nursery.start_soon(self._reservation_loop)
            task_status.started()

    # --- addresses --------------------------------------------------------------------------------------------------
    def advertised(self) -> list[str]:
        """What peers should dial, each ending in /p2p/<our id>."""
        return [with_peer(a, self.peer_id) for a in self._advertised().addresses]

    def _advertised(self) -> Any:
        v = self.verdict
        listen = [str(a) for a in self.host.get_transport_addrs()] or list(self.listen)
        verified = [a for a in v.verified if ip_of(a) not in self._own_ips] if v.reachable else []
        return advertised(listen, self._own_ips, announce=self.announce, verified=verified,
                          circuits=self.relay.circuit_addresses(), seen_from_public=v.seen_from_public,
                          reachable=v.reachable)

    def addrs_factory(self, _candidates: list[Any]) -> list[Any]:
        """py-libp2p's AddrsFactory: what identify and the relay protocol tell peers."""
        from multiaddr import Multiaddr

        out = []
        for a in self._advertised().addresses:
            with contextlib.suppress(Exception):
                out.append(Multiaddr(a))
        return out

    def _predicted(self) -> list[str]:
        """For hole punching: our WAN address (as peers saw it) at our listen port."""
        v = self.verdict
        if v.status != "behind-nat" or not v.observed_ip:
            return []
        ports = sorted({p for a in self.host.get_transport_addrs() if (p := tcp_port_of(str(a)))})
        return [tcp_address(v.observed_ip, p) for p in ports]

    # --- dialling -------------------------------------------------------------------------------------------------
    async def connect(self, peer: str, addresses: Sequence[str]) -> None:
        """Dial `peer`: its direct addresses worth trying, then through each relay it names; PeerUnreachable."""
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo
        from multiaddr import Multiaddr

        pid = ID.from_base58(peer)
        if addresses:
            self.known[peer] = tuple(addresses)
        direct, circuits = dialable([a for a in addresses if _peer_of(a) in ("", peer)], self._networks)
        circuits = [c for c in circuits if f"/p2p/{self.peer_id}/p2p-circuit" not in c]
        errors = []
        network = self.host.get_network()
        if direct or not circuits:
            network.unblock_peer(pid)  # a failed dial blocks the peer for 60 s otherwise
            try:
                with trio.fail_after(self.dial_timeout):
                    await self.host.connect(PeerInfo(pid, [Multiaddr(strip_peer(a)) for a in direct]))
                self.dial_errors.pop(peer, None)
                return
            except trio.TooSlowError:
                errors.append(f"no answer within {self.dial_timeout:g} s")
            except Exception as e:
                errors.append(_dial_error(e))
        for circuit in circuits:
            try:
                await self.relay.dial(peer, circuit)
                self.dial_errors.pop(peer, None)
                return
            except trio.TooSlowError:
                errors.append(f"through relay: no answer within {self.relay.timeout:g} s")
            except Exception as e:
                errors.append(f"through relay: {_dial_error(e)}")
        self.dial_errors[peer] = "; ".join(errors) or "no address to dial"
        raise PeerUnreachable(self.dial_errors[peer])

    async def ensure_connected(self, peer: str) -> None:
        """Before a stream: dial `peer` if no connection is up, through a relay when that is all it has
        (py-libp2p's own dialling skips relay addresses)."""
        from libp2p.peer.id import ID

        pid = ID.from_base58(peer)
        if self.host.get_network().connections.get(pid):
            return
        addrs = list(self.known.get(peer, ()))
        with contextlib.suppress(Exception):
            addrs += [with_peer(str(a), peer) for a in self.host.get_peerstore().addrs(pid)]
        await self.connect(peer, list(dict.fromkeys(addrs)))

    def _moved_direct(self, peer: str) -> None:
        """Hole punching worked: close the relayed connections, so the links to `peer` reopen on the direct one."""
        spawn(self._nursery, self._close_relayed, peer)

    async def _close_relayed(self, peer: str, grace: float = 1.0) -> None:
        from libp2p.peer.id import ID

        await trio.sleep(grace)
        conns = list(self.host.get_network().connections.get(ID.from_base58(peer), []))
        if "direct" not in connection_kinds(conns):
            return
        for conn in conns:
            if connection_kinds([conn]) == {"relayed"}:
                with contextlib.suppress(Exception):
                    await conn.close()
                log.info("closed the relayed connection to %s: links use the direct one", short_id(peer))

    # --- reachability ---------------------------------------------------------------------------------------------
    async def _serve_reach(self, peer: str, stream: Any) -> None:
        await self.server.serve(peer, stream, remote_of(stream))

    async def _check_loop(self) -> None:
        """Keep answers from up to `ASK_AT_ONCE` peers no older than `reach_interval`; ask new peers soon. A
        daemon that listens on loopback only asks no one: only this machine can reach it, and it can."""
        listen = [str(a) for a in self.host.get_transport_addrs()] or list(self.listen)
        concrete = [ip for raw in listen for a in _expand(raw, self._own_ips) if (ip := ip_of(a))]
        if concrete and all(scope_of(ip) is Scope.LOOPBACK for ip in concrete):
            self.verdict = Verdict("reachable", "loopback only: reachable from this machine alone",
                                   tuple(strip_peer(a) for a in listen), concrete[0])
            return
        while True:
            now, stale = trio.current_time(), self.config.reach_interval
            fresh = [p for p, r in self.reports.items() if now - r.at < stale]
            due = [p for p in self._direct_peers()
                   if now - self._asked_at.get(p, -1e9) >= (stale if p in self.reports else 10.0)]
            wanted = ASK_AT_ONCE if self.verdict.status == "unknown" else ASK_AT_ONCE - len(fresh)
            pick = [p for p in due if p not in self.reports][:max(0, wanted)]
            pick += [p for p in due if p in self.reports and now - self.reports[p].at >= stale]
            dp = self.data_plane_port()
            if dp and not any(r.dp for r in self.reports.values()):  # the data plane came up after the last check
                pick += [p for p in self.reports if p in self._direct_peers() and
                         now - self._asked_at.get(p, -1e9) >= self.config.reach_retry]
            if pick:
                async with trio.open_nursery() as nursery:
                    for peer in list(dict.fromkeys(pick))[:ASK_AT_ONCE]:
                        nursery.start_soon(self._ask, peer)
                self._update_verdict()
            await trio.sleep(self.config.reach_retry)

    def _direct_peers(self) -> list[str]:
        out = []
        for pid, conns in list(self.host.get_network().connections.items()):
            if "direct" in connection_kinds(conns):
                out.append(pid.to_base58())
        return sorted(out)

    async def _ask(self, peer: str) -> None:
        from libp2p.peer.id import ID

        self._asked_at[peer] = trio.current_time()
        ports = sorted({p for a in self.host.get_transport_addrs() if (p := tcp_port_of(str(a)))})
        addrs = sorted({a for raw in (str(x) for x in self.host.get_transport_addrs())
                        for a in _concrete(raw, self._own_ips)})
        request = Request(tuple(ports[:4]), tuple(addrs[:4]), self.data_plane_port() or 0)
        try:
            raw = await self.host.new_stream(ID.from_base58(peer), [PROTOCOL])
        except Exception as e:
            log.debug("cannot ask %s for a dial-back: %s", short_id(peer), _dial_error(e))
            return
        stream = Libp2pStream(raw)
        try:
            with trio.fail_after(self.config.reach_timeout * 2 + 5):
                answer = await ask(stream, request)
        except Exception as e:
            log.debug("dial-back by %s failed: %s", short_id(peer), _dial_error(e))
            return
        finally:
            with contextlib.suppress(Exception):
                await stream.close()
        conn = getattr(raw, "muxed_conn", None)
        we_dialled = bool(getattr(conn, "is_initiator_value", False))
        local = local_port_of(conn) if we_dialled else 0
        self.reports[peer] = Report(peer, answer.ip, answer.port, local, answer.results, answer.dp,
                                    trio.current_time())
        while len(self.reports) > MAX_REPORTS:
            del self.reports[min(self.reports, key=lambda p: self.reports[p].at)]

    def _update_verdict(self) -> None:
        new = verdict(sorted(self.reports.values(), key=lambda r: r.at), self._own_ips)
        if (new.status, new.summary) != (self.verdict.status, self.verdict.summary):
            log.info("reachability: %s", new.summary)
        self.verdict = new

    # --- reservations ---------------------------------------------------------------------------------------------
    def wants_relays(self) -> bool:
        status = self.verdict.status
        return status in ("behind-nat", "firewalled") or (status == "unknown" and bool(self.config.relays))

    def relay_candidates(self) -> list[tuple[str, tuple[str, ...]]]:
        """(relay, its direct public addresses): the `--relay` ones first, then members reached directly whose
        descriptors advertise public addresses and no relay address (a member behind NAT relays for no one)."""
        out: list[tuple[str, tuple[str, ...]]] = []
        for text in self.config.relays:
            relay = _peer_of(text)
            if relay and relay != self.peer_id:
                out.append((relay, (strip_peer(text),)))
        members = self.members()
        for peer in self._direct_peers():
            addrs = [strip_peer(a) for a in members.get(peer, ())]
            if peer == self.peer_id or any(r == peer for r, _ in out) or any(is_circuit(a) for a in addrs):
                continue
            public = tuple(a for a in addrs if (ip := ip_of(a)) is not None and scope_of(ip) is Scope.PUBLIC)
            if public:
                out.append((peer, public))
        return out

    async def _reservation_loop(self) -> None:
        import time

        from libp2p.peer.id import ID

        while True:
            await trio.sleep(2.0)
            if not self.wants_relays():
                for relay in list(self.relay.reservations):
                    self.relay.drop_reservation(relay)
                continue
            network = self.host.get_network()
            for relay in list(self.relay.reservations):  # a relay we lost is no relay: reserve elsewhere
                if not network.connections.get(ID.from_base58(relay)):
                    self.relay.drop_reservation(relay)
            for relay, res in list(self.relay.reservations.items()):
                if res.expires - time.time() < 120:
                    why = await self.relay.reserve(relay, res.addrs)
                    if why:
                        log.info("refreshing the reservation on %s failed: %s", short_id(relay), why)
                        self.relay.drop_reservation(relay)
            now = trio.current_time()
            for relay, addrs in self.relay_candidates():
                if len(self.relay.reservations) >= self.config.max_reservations:
                    break
                if relay in self.relay.reservations or now - self._refused_at.get(relay, -1e9) < \
                        self.config.reservation_retry:
                    continue
                why = await self.relay.reserve(relay, addrs)
                if why:
                    self._refused_at[relay] = now
                    self.relay.refused[relay] = why
                    log.info("no reservation on %s: %s", short_id(relay), why)

    # --- the data plane ---------------------------------------------------------------------------------------------
    def may_offer_data_plane(self, peer: str, raw_stream: Any) -> tuple[bool, str]:
        """Whether to hand `peer` (on this libp2p stream) a data-plane token: only where its dial can arrive."""
        why = data_plane_refusal(remote_of(raw_stream), self.verdict, self._networks)
        if why:
            self.offers[peer] = why
        else:
            self.offers.pop(peer, None)
        return not why, why

    # --- status -----------------------------------------------------------------------------------------------------
    def link_facts(self, peer: str) -> LinkFacts:
        from libp2p.peer.id import ID

        conns = list(self.host.get_network().connections.get(ID.from_base58(peer), []) or [])
        kinds = connection_kinds(conns)
        info = self.plane_out(peer)
        plane_out = None if info is None else ("data-plane" if info.path is LinkPath.DATA_PLANE else "libp2p",
                                               info.reason)
        plane_in = self.plane_in(peer)
        punch = self.puncher.status().get(peer) if self.puncher is not None else None
        return LinkFacts(peer, frozenset(kinds), relay_of_connection(conns), plane_out, plane_in,
                         self.offers.get(peer, ""), punch, self.dial_errors.get(peer, ""))

    def links(self) -> list[dict[str, str]]:
        """One entry per member (and any other connected peer): its path and why."""
        peers = set(self.members()) | {pid.to_base58() for pid, conns in self.host.get_network().connections.items()
                                       if conns}
        peers.discard(self.peer_id)
        return [describe(self.link_facts(p)) for p in sorted(peers)]

    def link_kinds(self) -> dict[str, str]:
        return kinds_for_descriptor(self.links())

    def link_paths(self) -> dict[str, LinkInfo]:
        """`Network.link_paths`: the connected peers' entries of `links`."""
        return {e["peer_id"]: LinkInfo(LinkPath(e["path"]), e["reason"]) for e in self.links() if e["path"] != "none"}

    def status(self) -> dict[str, Any]:
        adv = self._advertised()
        return {
            "listen": [str(a) for a in self.host.get_transport_addrs()],
            "advertised": [with_peer(a, self.peer_id) for a in adv.addresses],
            "advertised_because": adv.reason,
            "announce": list(self.announce),
            "reachability": self.verdict.to_json(),
            "relay": self.relay.status(),
            "hole_punching": self.puncher.status() if self.puncher is not None else None,
            "data_plane": {"port": self.data_plane_port(), "not_offered": dict(self.offers)},
            "dial_errors": {p: e for p, e in self.dial_errors.items() if not self._connected(p)},
        }

    def _connected(self, peer: str) -> bool:
        from libp2p.peer.id import ID

        return bool(self.host.get_network().connections.get(ID.from_base58(peer)))


def _peer_of(addr: str) -> str:
    """The last /p2p/ id of an address ('' when none)."""
    _, sep, tail = addr.rpartition("/p2p/")
    return tail if sep and "/" not in tail else ""


def _concrete(listen: str, own_ips: Sequence[str]) -> list[str]:
    return [a for a in _expand(listen, own_ips) if (ip := ip_of(a)) and scope_of(ip) > Scope.LOOPBACK]


def _expand(listen: str, own_ips: Sequence[str]) -> list[str]:
    from swarmd.net.addresses import expand

    return expand(listen, own_ips)


def _dial_error(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    cause = e
    for _ in range(5):
        nxt = cause.__cause__ or cause.__context__
        if nxt is None:
            break
        cause = nxt
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    line = f"{type(e).__name__}: {text}" if text else type(e).__name__
    if cause is not e and str(cause):
        line += f" ({type(cause).__name__}: {str(cause).strip().splitlines()[0]})"
    return line[:300]


def data_plane_refusal(remote: tuple[str, int] | None, verdict: Verdict, networks: Sequence[Any]) -> str:
    """Why a peer at `remote` (None: it reaches us through a relay only) should not be offered our data plane, or ''
    to offer it: it must be able to dial our data-plane port — from this machine or our LAN, or because peers
    outside dialled it back (or the daemon is reachable and the port was not checked yet)."""
    if remote is None:
        return "its only connection goes through a relay"
    ip = remote[0]
    if scope_of(ip) is Scope.LOOPBACK or on_link(ip, networks) or verdict.data_plane:
        return ""
    if verdict.reachable and verdict.data_plane is None:
        return ""
    return ("this daemon's data-plane port is not reachable from outside its network"
            + (" (behind NAT)" if verdict.status == "behind-nat" else ""))


def data_plane_config(listen: Sequence[str], announce: Sequence[str], port: int = 0) -> Any:
    """The TLS data plane listens where libp2p listens (the first TCP listen address's host, a wildcard
    included) and, with `--announce`, tells dialers the announced host; otherwise they use the address they
    reached us at over libp2p."""
    from swarmd.net.tls_plane import DataPlaneConfig

    bind = "127.0.0.1"
    for a in listen:
        if not is_circuit(a) and tcp_port_of(a) is not None and (ip := ip_of(a)):  # port 0 (any) included
            bind = ip
            break
    host = ""
    for a in announce:
        if not is_circuit(a) and (ip := ip_of(a)) and scope_of(ip) is not Scope.UNUSABLE:
            host = ip
            break
    return DataPlaneConfig(bind_host=bind, bind_port=port, announce_host=host)
