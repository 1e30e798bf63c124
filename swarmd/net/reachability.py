"""Is this daemon reachable? Asked of peers, who dial it back on a new connection (`/swarmd/reach/1.0.0`).

py-libp2p 0.8.1's AutoNAT cannot answer this: its server "dials back" with `host.connect`, which returns at once
because the asker is already connected, so every address that passes its IP filter is reported reachable
(../shared notes, py-libp2p-nat.md, bugs 1-3). Here the answering peer opens a brand-new TCP connection to each
address it is asked about and completes the security handshake on it (the peer id must match), then closes it;
it never dials an IP other than the one the request came from (no reflection). It also tries a bare TCP
connection to the asker's data-plane port.

    request   {"v": 1, "ports": [listen tcp ports], "addrs": [listen addresses], "dp": data-plane port or 0}
    answer    {"v": 1, "ip": observed ip, "port": observed port, "results": {address: outcome}, "dp": outcome}
    outcome   "ok" | "refused" | "timeout" | "error: ..."

What the answers mean is decided by `verdict`, a pure function of the reports gathered: reachable (and at
which verified addresses), or behind NAT and of what kind as far as can be told from outside — whether the
NAT keeps source ports (hole punching predicts the port from it) and whether it drops unsolicited connections
(hole punching can work) or answers them with a RST (it cannot: the first SYN kills both sides' attempt).
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2
import trio

from swarmd.errors import RemoteProtocolError
from swarmd.net.addresses import Scope, ip_of, scope_of, tcp_address, tcp_port_of
from swarmd.net.seam import BadFrame, Stream
from swarmd.net.streams import read_frame, write_frame

log = logging.getLogger("swarmd.reach")

PROTOCOL = "/swarmd/reach/1.0.0"
MAX_FRAME = 4096
MAX_TARGETS = 8
OK, REFUSED, TIMEOUT = "ok", "refused", "timeout"

DialBack = Callable[[str, str], Awaitable[None]]  # (address, peer id) -> None, or raises
TcpProbe = Callable[[str, int], Awaitable[None]]  # (ip, port) -> None, or raises


# --- the wire --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    ports: tuple[int, ...]
    addrs: tuple[str, ...] = ()
    dp_port: int = 0

    def encode(self) -> bytes:
        return cbor2.dumps({"v": 1, "ports": list(self.ports), "addrs": list(self.addrs), "dp": self.dp_port})

    @staticmethod
    def decode(data: bytes) -> Request:
        doc = _strict_map(data, {"v", "ports", "addrs", "dp"})
        ports, addrs, dp = doc.get("ports", []), doc.get("addrs", []), doc.get("dp", 0)
        if (not isinstance(ports, list) or not all(_port(p) for p in ports) or not isinstance(addrs, list)
                or not all(isinstance(a, str) and len(a) < 256 for a in addrs) or not (dp == 0 or _port(dp))):
            raise RemoteProtocolError("reach request: ports, addrs or dp of the wrong type")
        if len(ports) + len(addrs) > MAX_TARGETS:
            raise RemoteProtocolError(f"reach request: more than {MAX_TARGETS} targets")
        return Request(tuple(ports), tuple(addrs), dp)


@dataclass(frozen=True)
class Answer:
    ip: str
    port: int
    results: dict[str, str]
    dp: str = ""

    def encode(self) -> bytes:
        return cbor2.dumps({"v": 1, "ip": self.ip, "port": self.port, "results": self.results, "dp": self.dp})

    @staticmethod
    def decode(data: bytes) -> Answer:
        doc = _strict_map(data, {"v", "ip", "port", "results", "dp"})
        ip, port, results, dp = doc.get("ip"), doc.get("port"), doc.get("results", {}), doc.get("dp", "")
        if (not isinstance(ip, str) or not isinstance(port, int) or not isinstance(results, dict) or
                not isinstance(dp, str) or len(results) > MAX_TARGETS or
                not all(isinstance(k, str) and isinstance(v, str) for k, v in results.items())):
            raise RemoteProtocolError("reach answer: fields of the wrong type")
        return Answer(ip, port, dict(results), dp)


def _port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def _strict_map(data: bytes, known: set[str]) -> dict[str, Any]:
    try:
        doc = cbor2.loads(data)
    except Exception as e:
        raise RemoteProtocolError(f"reach message is not CBOR: {type(e).__name__}") from None
    if not isinstance(doc, dict) or doc.get("v") != 1 or not set(doc) <= known:
        raise RemoteProtocolError("reach message: not a version-1 map with known keys")
    return doc


# --- what the answers mean ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Report:
    """One peer's answer, with what this daemon knows about the connection it asked over."""

    peer: str
    ip: str  # where the peer saw us
    port: int  # the source port it saw
    local_port: int  # our source port on that connection (0: unknown, or the peer dialled us)
    results: dict[str, str]
    dp: str
    at: float

    @property
    def public(self) -> bool:
        return scope_of(self.ip) is Scope.PUBLIC


@dataclass(frozen=True)
class Verdict:
    status: str  # "reachable" | "behind-nat" | "firewalled" | "unknown"
    summary: str  # one line for status and doctor: "public", "behind NAT (port-preserving, drops ...)"
    verified: tuple[str, ...] = ()  # addresses a peer dialled back successfully
    observed_ip: str = ""  # the widest-scope address peers saw us at
    seen_from_public: bool = False
    data_plane: bool | None = None  # a peer opened a TCP connection to the data-plane port
    nat: dict[str, Any] = field(default_factory=dict)  # port_preserving, unsolicited: "drop" | "rst" | ...
    asked: tuple[str, ...] = ()  # the peers whose answers this rests on

    @property
    def reachable(self) -> bool | None:
        return {"reachable": True, "behind-nat": False, "firewalled": False}.get(self.status)

    @property
    def hole_punching_viable(self) -> bool | None:
        """False where the NAT answers unsolicited SYNs with RST or changes source ports; None if unknown."""
        if self.status != "behind-nat":
            return None
        return self.nat.get("unsolicited") != "rst" and self.nat.get("port_preserving") is not False

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "summary": self.summary, "verified": list(self.verified),
                "observed_ip": self.observed_ip, "data_plane_reachable": self.data_plane, "nat": self.nat,
                "asked": list(self.asked)}


UNKNOWN = Verdict("unknown", "unknown: no peer has dialled this daemon back yet")


def verdict(reports: Sequence[Report], own_ips: Sequence[str]) -> Verdict:
    """What the latest report of each peer says. Reports from peers that saw us at a public address decide
    when there are any (a LAN peer can reach us where the internet cannot); otherwise the LAN ones do."""
    if not reports:
        return UNKNOWN
    public = [r for r in reports if r.public]
    basis = public or list(reports)
    seen_from_public = bool(public)
    observed = basis[-1].ip
    asked = tuple(sorted({r.peer for r in basis}))
    outcomes = [o for r in basis for o in r.results.values()]
    verified = tuple(dict.fromkeys(a for r in basis for a, o in r.results.items() if o == OK))
    dp_outcomes = [r.dp for r in basis if r.dp]
    data_plane = (OK in dp_outcomes) if dp_outcomes else None
    behind_nat = observed not in own_ips
    where = "public" if seen_from_public else "on a private network"
    if verified:
        how = f"{where}, via a NAT with a forwarded port" if behind_nat else where
        return Verdict("reachable", f"{how} ({', '.join(_hostport(a) for a in verified)} dialled back by "
                                    f"{len(asked)} peer{'s' if len(asked) != 1 else ''})",
                       verified, observed, seen_from_public, data_plane, {}, asked)
    if not outcomes:
        return Verdict("unknown", f"unknown: peers saw this daemon at {observed} but had no address to dial back",
                       (), observed, seen_from_public, data_plane, {}, asked)
    if REFUSED not in outcomes and TIMEOUT not in outcomes:
        return Verdict("unknown", f"unknown: the dial-backs failed before reaching {observed} "
                                  f"({sorted(set(outcomes))[0]})", (), observed, seen_from_public, data_plane, {}, asked)
    unsolicited = REFUSED if outcomes.count(REFUSED) > outcomes.count(TIMEOUT) else TIMEOUT
    if not behind_nat:
        what = "refuses" if unsolicited == REFUSED else "drops"
        return Verdict("firewalled", f"not reachable: a firewall {what} inbound connections to the listen port",
                       (), observed, seen_from_public, data_plane, {"unsolicited": "rst" if unsolicited == REFUSED
                                                                    else "drop"}, asked)
    preserving = [r.port == r.local_port for r in basis if r.local_port]
    port_preserving = all(preserving) if preserving else None
    nat = {"unsolicited": "rst" if unsolicited == REFUSED else "drop", "port_preserving": port_preserving,
           "wan_ip": observed}
    kind = []
    if port_preserving is not None:
        kind.append("port-preserving" if port_preserving else "port-randomising")
    kind.append("answers unsolicited connections with RST" if unsolicited == REFUSED
                else "drops unsolicited connections")
    viable = unsolicited != REFUSED and port_preserving is not False
    kind.append("hole punching can work" if viable else "hole punching cannot work: relayed links only")
    return Verdict("behind-nat", f"behind NAT ({', '.join(kind)})", (), observed, seen_from_public, data_plane,
                   nat, asked)


def _hostport(addr: str) -> str:
    ip, port = ip_of(addr), tcp_port_of(addr)
    return f"{ip}:{port}" if ip and port else addr


# --- both sides of the protocol ---------------------------------------------------------------------------------
def classify(exc: BaseException) -> str:
    """An outcome word for a failed dial: refused (a RST came back), timeout (nothing came back), or
    "error: ..." (the network said no route, or something else). Looks through causes and exception groups:
    py-libp2p and trio wrap the socket's error two or three times."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen or len(seen) > 32:
            continue
        seen.add(id(e))
        if isinstance(e, trio.TooSlowError):
            return TIMEOUT
        if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
            return REFUSED
        if getattr(e, "errno", None) in (errno.ETIMEDOUT,):
            return TIMEOUT
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)
    root = exc
    return f"error: {type(root).__name__}: {str(root).strip()[:120]}"


class ReachServer:
    """Answers `/swarmd/reach/1.0.0`: dials each asked address back on a new connection (IP of the request only)."""

    def __init__(self, dial_back: DialBack, probe_tcp: TcpProbe, timeout: float = 3.0) -> None:
        self.dial_back, self.probe_tcp, self.timeout = dial_back, probe_tcp, timeout
        self.answered = 0

    async def serve(self, peer: str, stream: Stream, remote: tuple[str, int] | None) -> None:
        request = Request.decode(await read_frame(stream, MAX_FRAME))
        if remote is None:  # a relayed stream: there is no address of the asker to dial
            raise BadFrame("reach request over a connection without an address")
        ip, port = remote
        targets = [tcp_address(ip, p) for p in request.ports]
        targets += [a for a in request.addrs if ip_of(a) == ip and tcp_port_of(a) and a not in targets]
        results: dict[str, str] = {}

        async def one(addr: str) -> None:
            results[addr] = await self._outcome(self.dial_back(addr, peer))

        dp = ""
        async with trio.open_nursery() as nursery:
            for addr in targets[:MAX_TARGETS]:
                nursery.start_soon(one, addr)
            if request.dp_port:
                async def data_plane() -> None:
                    nonlocal dp
                    dp = await self._outcome(self.probe_tcp(ip, request.dp_port))
                nursery.start_soon(data_plane)
        self.answered += 1
        await write_frame(stream, Answer(ip, port, results, dp).encode())

    async def _outcome(self, attempt: Awaitable[None]) -> str:
        try:
            with trio.fail_after(self.timeout):
                await attempt
        except Exception as e:
            return classify(e)
        return OK


async def ask(stream: Stream, request: Request) -> Answer:
    """Send `request` and read the answer (bound the wait with a cancel scope around it)."""
    await write_frame(stream, request.encode())
    return Answer.decode(await read_frame(stream, MAX_FRAME))


# --- py-libp2p: a dial-back on a brand-new connection -----------------------------------------------------------
def libp2p_dial_back(host: Any) -> DialBack:
    """A fresh TCP connection to `address` and the security handshake on it (the peer id must be `peer`), then
    closed; never registered with the swarm (which would reuse or trim connections)."""

    async def dial_back(address: str, peer: str) -> None:
        from libp2p.peer.id import ID
        from libp2p.security.pnet.protector import new_protected_conn
        from multiaddr import Multiaddr

        network = host.get_network()
        ma = Multiaddr(address)
        transport = network.transport_manager.transport_for_dialing(ma)
        if transport is None:
            raise ValueError(f"no transport dials {address}")
        raw = await transport.dial(ma)
        try:
            if getattr(network, "psk", None) is not None:
                raw = new_protected_conn(raw, network.psk)
            secured = await network.upgrader.upgrade_security(raw, True, ID.from_base58(peer))
            with contextlib.suppress(Exception):
                await secured.close()
        finally:
            with contextlib.suppress(Exception):
                await raw.close()

    return dial_back


async def tcp_probe(ip: str, port: int) -> None:
    stream = await trio.open_tcp_stream(ip, port)
    with contextlib.suppress(Exception):
        await stream.aclose()


def remote_of(raw_stream: Any) -> tuple[str, int] | None:
    """(ip, port) of the far end of a libp2p stream's connection (under wrappers, if any); None for a relayed one
    or where it cannot be told."""
    for _ in range(4):  # under the guard's and the seam's wrappers
        if hasattr(raw_stream, "muxed_conn"):
            break
        inner = getattr(raw_stream, "_stream", None) or getattr(raw_stream, "stream", None)
        if inner is None:
            break
        raw_stream = inner
    conn = getattr(raw_stream, "muxed_conn", None)
    with contextlib.suppress(Exception):
        for a in conn.get_transport_addresses():  # type: ignore[union-attr]
            if "/p2p-circuit" in str(a):
                return None
    with contextlib.suppress(Exception):
        address = raw_stream.get_remote_address()
        if address:
            return str(address[0]), int(address[1])
    return None


def local_port_of(conn: Any) -> int:
    """Our source port on a py-libp2p connection (0 when it cannot be found): dug out of its layers."""
    seen: set[int] = set()
    todo = [conn]
    for _ in range(40):
        if not todo:
            break
        obj = todo.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, trio.SocketStream):
            with contextlib.suppress(Exception):
                return int(obj.socket.getsockname()[1])
            return 0
        for name in ("muxed_conn", "secured_conn", "conn", "read_writer", "raw_conn", "stream", "_stream",
                     "_wrapped"):
            with contextlib.suppress(Exception):
                child = object.__getattribute__(obj, name)
                if child is not None:
                    todo.append(child)
    return 0


def describe_targets(request: Request) -> str:
    return ", ".join([*(f"port {p}" for p in request.ports), *request.addrs]) or "nothing"
