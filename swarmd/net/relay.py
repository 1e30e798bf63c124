"""Circuit relay v2: serving it, holding reservations on relays, and dialling peers through them.

A daemon that peers can reach serves as a relay for the swarm (`--no-relay-service` opts out) within limits:
reservations, circuits per reserved peer, and per circuit its bytes and its lifetime. A daemon that peers
cannot reach keeps reservations on up to `max_reservations` relays — members it reaches directly that serve
relaying, or the `--relay` addresses — and advertises `/p2p-circuit` addresses through them.

py-libp2p 0.8.1 pieces, and what is done differently (../shared notes, py-libp2p-nat.md):
- the relay is its `CircuitV2Protocol`, with one fix: when a circuit ends it closed the streams of whichever
  circuit to the same peer was opened last (its bookkeeping is keyed by peer id), killing a healthy one;
  here each circuit closes its own two streams;
- a circuit is opened by our own CONNECT exchange instead of `CircuitV2Transport.dial`, which sent a new
  RESERVE before every CONNECT and never used the limits the relay answers with; `host.connect` and
  `host.new_stream` never use relay addresses at all (bug 8), so every dial through a relay is explicit;
- the dialler counts a circuit's bytes (the relay's budget counts both directions) and its age, and moves to
  a fresh circuit before either limit is reached, so a relay never cuts a circuit in the middle of a frame.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import trio

from swarmd.net.addresses import circuit_address, relay_of, strip_peer
from swarmd.net.identity import short_id

log = logging.getLogger("swarmd.relay")

HOP = "/libp2p/circuit/relay/0.2.0/hop"
ROTATE_AT = 0.75  # of a circuit's byte budget or lifetime: open the next one before the relay cuts this one
HARD_STOP = 0.95  # of its byte budget: a circuit is closed rather than carry a write past this


@dataclass(frozen=True)
class RelayLimits:
    reservations: int = 32  # peers holding a reservation on this relay at once
    circuits_per_peer: int = 8  # circuits to one reserved peer at once
    circuit_bytes: int = 1 << 30  # both directions together; 0: unlimited
    circuit_seconds: int = 3600  # 0: unlimited
    reservation_seconds: int = 3600

    def libp2p(self) -> Any:
        from libp2p.relay.circuit_v2.resources import RelayLimits as Limits

        return Limits(duration=self.circuit_seconds, data=self.circuit_bytes,
                      max_circuit_conns=self.circuits_per_peer, max_reservations=self.reservations,
                      reservation_ttl=self.reservation_seconds)

    def to_json(self) -> dict[str, int]:
        return {"reservations": self.reservations, "circuits_per_peer": self.circuits_per_peer,
                "circuit_bytes": self.circuit_bytes, "circuit_seconds": self.circuit_seconds}


@dataclass
class Reservation:
    relay: str
    addrs: tuple[str, ...]  # where the relay listens (direct addresses, no /p2p/)
    expires: float  # unix time
    since: float


@dataclass
class Circuit:
    """A connection we opened through a relay, and how much of the relay's budget it has used."""

    peer: str
    relay: str
    raw: Any  # CountingRaw
    conn: Any  # the swarm connection
    opened: float  # trio time
    limit_bytes: int
    limit_seconds: int

    def worn(self, now: float) -> str:
        """Why this circuit should make way for a fresh one, or ''."""
        used = self.raw.bytes_in + self.raw.bytes_out
        if self.limit_bytes and used >= ROTATE_AT * self.limit_bytes:
            return f"{used} of its {self.limit_bytes} bytes used"
        if self.limit_seconds and now - self.opened >= ROTATE_AT * self.limit_seconds:
            return f"{now - self.opened:.0f} of its {self.limit_seconds} s used"
        return ""


def _protocol_class() -> type:
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol

    class SwarmdRelayProtocol(CircuitV2Protocol):  # type: ignore[misc, valid-type]
        served = 0

        async def _handle_hop_stream(self, stream: Any) -> None:
            """Upstream's handler, then the stream closed: it returns on a bad or missing message (and after a
            circuit, which it runs inside) without closing it, leaving the peer waiting for an end."""
            try:
                await super()._handle_hop_stream(stream)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await self._close_stream(stream)

        async def _relay_data(self, src: Any, dst: Any, peer_id: Any, deadline: float | None = None,
                              circuit_data_limit: list[int] | None = None) -> None:
            self.served += 1 if peer_id is not None else 0
            try:  # peer None: upstream's clean-up by peer id (which may be another circuit's) finds nothing
                await super()._relay_data(src, dst, None, deadline, circuit_data_limit)  # type: ignore[arg-type]
            finally:
                with trio.CancelScope(shield=True):
                    await self._close_stream(src)
                    await self._close_stream(dst)

    return SwarmdRelayProtocol


def _counting_raw_class() -> type:
    from libp2p.network.connection.raw_connection import RawConnection

    class CountingRaw(RawConnection):  # type: ignore[misc, valid-type]
        """A relayed stream as a raw connection, counting what crosses the relay. Past `ROTATE_AT` of `budget`
        it calls `worn` (a fresh circuit is opened); a write that would take the circuit past `HARD_STOP` of it
        closes the circuit instead of being sent (the relay would cut it there, mid-frame)."""

        bytes_in = 0
        bytes_out = 0
        budget = 0
        worn: Any = None

        async def read(self, n: int | None = None) -> bytes:
            data = await super().read(n)
            self.bytes_in += len(data)
            self._check()
            return data

        async def write(self, data: bytes) -> None:
            used = self.bytes_in + self.bytes_out
            if self.budget and used + len(data) > HARD_STOP * self.budget:
                from libp2p.network.connection.exceptions import RawConnError

                with contextlib.suppress(Exception):
                    await super().close()
                raise RawConnError(f"the circuit's byte budget at the relay is spent ({used} of {self.budget})")
            await super().write(data)
            self.bytes_out += len(data)
            self._check()

        def _check(self) -> None:
            if self.budget and self.worn is not None and self.bytes_in + self.bytes_out >= ROTATE_AT * self.budget:
                worn, self.worn = self.worn, None
                worn()

    return CountingRaw


class RelayClient:
    """Serves STOP (circuits to us) and HOP when `serve` is set; reserves on relays; dials through them."""

    def __init__(self, host: Any, self_id: str, *, serve: bool, limits: RelayLimits | None = None,
                 psk: str | None = None, timeout: float = 10.0) -> None:
        self.host, self.self_id, self.serve, self.psk = host, self_id, serve, psk
        self.limits = limits or RelayLimits()
        self.timeout = timeout
        self.protocol: Any = None
        self.reservations: dict[str, Reservation] = {}
        self.circuits: dict[str, Circuit] = {}  # by peer
        self.refused: dict[str, str] = {}  # relay -> why it refused a reservation
        self.stats: dict[str, int] = {"circuits_opened": 0, "circuits_rotated": 0, "reservations_made": 0}
        self._lock: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()  # a circuit passed ROTATE_AT of its bytes: replace it now, not at the next tick

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from libp2p.tools.anyio_service import background_trio_service

        self.protocol = _protocol_class()(self.host, limits=self.limits.libp2p(), allow_hop=self.serve,
                                          read_timeout=int(self.timeout), write_timeout=int(self.timeout))
        async with background_trio_service(self.protocol), trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.protocol.event_started.wait()
            task_status.started()
            while True:
                with trio.move_on_after(1.0):
                    await self._wake.wait()
                self._wake = trio.Event()
                await self._rotate_worn()

    # --- reservations ---------------------------------------------------------------------------------------------
    async def reserve(self, relay: str, addrs: tuple[str, ...]) -> str:
        """A reservation on `relay` (connected to it directly first); '' on success, else why not."""
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

        pid = ID.from_base58(relay)
        try:
            with trio.fail_after(self.timeout):
                await self._connect_direct(pid, addrs)
                stream = await self.host.new_stream(pid, [HOP])
                try:
                    await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE,
                                                                 peer=CircuitPeerId(id=self.host.get_id().to_bytes())))
                    resp = await read_delimited_msg(stream, HopMessage)
                finally:
                    with contextlib.suppress(Exception):
                        await stream.close()
        except trio.TooSlowError:
            return f"no answer within {self.timeout:g} s"
        except Exception as e:
            return _why(e)
        status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.OK
        if status != StatusCode.OK:
            return f"the relay refused: {status.name}"
        expires = float(resp.reservation.expire) if resp.HasField("reservation") else time.time() + 600
        known = self.reservations.get(relay)
        self.reservations[relay] = Reservation(relay, addrs, expires, known.since if known else time.time())
        if known is None:
            self.stats["reservations_made"] += 1
            log.info("reservation on relay %s until %s", short_id(relay), time.strftime("%H:%M:%S",
                                                                                        time.localtime(expires)))
        self.refused.pop(relay, None)
        return ""

    def drop_reservation(self, relay: str) -> None:
        if self.reservations.pop(relay, None) is not None:
            log.info("reservation on relay %s dropped", short_id(relay))

    def circuit_addresses(self) -> list[str]:
        """Where peers reach us: through each relay holding a reservation for us, at each of its addresses."""
        return [circuit_address(a, r.relay, self.self_id) for r in self.reservations.values() for a in r.addrs]

    # --- dialling through a relay -----------------------------------------------------------------------------------
    async def dial(self, peer: str, circuit: str) -> None:
        """Open a connection to `peer` through the relay named in `circuit` (`.../p2p/R/p2p-circuit/p2p/peer`)."""
        lock = self._lock.setdefault(peer, trio.Lock())
        async with lock:
            if self._connected(peer):
                return
            await self._dial_locked(peer, circuit)

    async def _dial_locked(self, peer: str, circuit: str) -> Circuit:
        from libp2p.connection_types import ConnectionType
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
        from libp2p.security.pnet.protector import new_protected_conn
        from multiaddr import Multiaddr

        relay_addr, relay = relay_of(circuit)
        relay_pid, peer_pid = ID.from_base58(relay), ID.from_base58(peer)
        if relay == self.self_id:
            raise ConnectionError("a circuit through this daemon itself")
        with trio.fail_after(self.timeout):
            await self._connect_direct(relay_pid, (relay_addr,) if relay_addr else ())
            stream = await self.host.new_stream(relay_pid, [HOP])
            try:
                await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT,
                                                             peer=CircuitPeerId(id=peer_pid.to_bytes())))
                resp = await read_delimited_msg(stream, HopMessage)
                status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.OK
                if status != StatusCode.OK:
                    raise ConnectionError(f"relay {short_id(relay)} refused the circuit: {status.name}")
                limit_bytes = int(resp.limit.data) if resp.HasField("limit") else 0
                limit_seconds = int(resp.limit.duration) if resp.HasField("limit") else 0
                ma = Multiaddr(f"/p2p/{relay}/p2p-circuit/p2p/{peer}")
                raw = _counting_raw_class()(stream=stream, initiator=True, connection_type=ConnectionType.RELAYED,
                                            addresses=[ma])
                raw.budget = limit_bytes
                raw.worn = lambda: self._wake.set()
                wire = new_protected_conn(raw, self.psk) if self.psk else raw
                conn = await self.host.upgrade_outbound_connection(wire, peer_pid)
            except BaseException:
                with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await stream.reset()
                raise
        with contextlib.suppress(Exception):
            conn.set_transport_info([ma], ConnectionType.RELAYED)
        found = Circuit(peer, relay, raw, conn, trio.current_time(), limit_bytes, limit_seconds)
        self.circuits[peer] = found
        self.stats["circuits_opened"] += 1
        log.info("connected to %s through relay %s", short_id(peer), short_id(relay))
        return found

    async def _rotate_worn(self) -> None:
        now = trio.current_time()
        for peer, circuit in list(self.circuits.items()):
            if bool(getattr(circuit.conn, "is_closed", False)):
                del self.circuits[peer]
                continue
            why = circuit.worn(now)
            if not why:
                continue
            log.info("circuit to %s through %s: %s: moving to a fresh circuit", short_id(peer),
                     short_id(circuit.relay), why)
            self.stats["circuits_rotated"] += 1
            del self.circuits[peer]
            # the old circuit goes first: the relay must never carry the two at once past its limits
            with contextlib.suppress(Exception):
                await circuit.conn.close()
            try:  # the relay is still connected: the circuit needs no address of it
                await self.dial(peer, f"/p2p/{circuit.relay}/p2p-circuit/p2p/{peer}")
            except Exception as e:
                log.info("new circuit to %s failed: %s (the next dial tries again)", short_id(peer), _why(e))

    async def _connect_direct(self, pid: Any, addrs: tuple[str, ...]) -> None:
        from libp2p.peer.peerinfo import PeerInfo
        from multiaddr import Multiaddr

        network = self.host.get_network()
        if network.connections.get(pid):
            return
        network.unblock_peer(pid)
        await self.host.connect(PeerInfo(pid, [Multiaddr(strip_peer(a)) for a in addrs if a]))

    def _connected(self, peer: str) -> bool:
        from libp2p.peer.id import ID

        return bool(self.host.get_network().connections.get(ID.from_base58(peer)))

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        served = self.protocol.resource_manager if self.protocol is not None else None
        return {
            "serving": self.serve,
            "limits": self.limits.to_json() if self.serve else None,
            "reservations_held_here": len(getattr(served, "_reservations", {}) or {}) if self.serve else 0,
            "circuits_relayed": getattr(self.protocol, "served", 0) // 2 if self.protocol is not None else 0,
            "reservations": [{"relay": r.relay, "addrs": list(r.addrs), "expires_in_s": round(r.expires - time.time())}
                             for r in self.reservations.values()],
            "refused": dict(self.refused),
            "circuits": [{"peer": c.peer, "relay": c.relay, "bytes": c.raw.bytes_in + c.raw.bytes_out,
                          "age_s": round(now - c.opened, 1), "limit_bytes": c.limit_bytes,
                          "limit_seconds": c.limit_seconds} for c in self.circuits.values()],
            **self.stats,
        }


def _why(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:200] if text else type(e).__name__
