"""The in-memory twin of the network seam: whole swarms in one process, in virtual time, with link faults.

One `MemoryHub` stands for the wire. Each daemon gets an endpoint (`hub.endpoint(peer_id)`, a
`swarmd.net.seam.Network`), with the daemon's peer gate and stream guard as the libp2p network has them.
Gossip reaches every subscribed endpoint connected to the publisher through some chain of connections (as
gossipsub relays); streams are pairs of in-memory pipes that deliver each write after the link's delay.

What a test or a simulation can do to the wire, as the link emulator and `kill -9` do to real daemons:
- `set_delay(a, b, s)`: one-way delay between two peers (`default_delay` for the rest);
- `gossip_loss`: the chance that one gossip message is lost on its way to one peer (`rng` draws it);
- `reset(a, b)`: break the streams between two peers (their connection stays, as after a flaky reset);
- `hang_up(a, b)`: close their connection and its streams; `partition(*groups)` / `heal()`;
- `black_hole(a, b)`: bytes between them vanish and nobody notices, until `mend(a, b)`; a stream that lost
  bytes stays silent for good (a TCP connection that timed out without either side hearing of it);
- `crash(peer)`: the process dies (what a cancelled endpoint also does): every stream breaks at once;
  a restart is a new endpoint with the same peer id; `freeze(peer)` / `thaw(peer)`: a hung process (its
  streams lose what is written meanwhile, as in a black hole);
- `behind_nat(peer)`: nobody can dial it; it dials out, and others reach it over the connections it
  opened or through a relay (a dialable peer connected to it), whose loss takes the relayed link along;
- `refuse_dials(peer)` / `serve_nothing(peer)`: dials to it fail, or succeed to a stream nobody reads;
- `stream_opens[(src, dst)]` counts streams opened, `wrap` lets a test wrap the dialer's end.

Bulk streams can be detached from the event loop, as the TLS data plane's (`swarmd.net.seam.DetachedStream`):
their reader is a task of the endpoint (where a real network has a thread), which calls the reader's methods
synchronously, and `send` writes at once from the caller; faults reach them as they reach any stream.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from swarmd.net.gate import GuardLimits, PeerGate
from swarmd.net.seam import (
    GossipMessage,
    LinkInfo,
    LinkPath,
    PeerUnreachable,
    Reader,
    Stream,
    StreamClosed,
    StreamHandler,
)
from swarmd.net.stream_guard import StreamGuard

log = logging.getLogger(__name__)

HANG_UP_DELAY = 0.25
Pair = frozenset[str]


def pair(a: str, b: str) -> Pair:
    return frozenset((a, b))


class _Pipe:
    """One direction of a stream: what is written arrives `delay` seconds later, in order."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.chunks: deque[tuple[float, bytes]] = deque()
        self.eof = False  # the writer closed its side: reads end once the chunks are read
        self.broken = ""  # a reset or a crash: writes fail at once, reads once what had arrived is read
        self.broken_at = 0.0
        self.arrived = trio.Event()

    def put(self, data: bytes) -> None:
        self.chunks.append((trio.current_time() + self.delay, bytes(data)))
        self._wake()

    def close(self) -> None:
        self.eof = True
        self._wake()

    def break_(self, reason: str) -> None:
        if not self.broken:
            self.broken, self.broken_at = reason, trio.current_time()
        self._wake()

    def _wake(self) -> None:
        self.arrived.set()
        self.arrived = trio.Event()

    async def get(self, n: int) -> bytes:
        while True:
            if self.broken and not (self.chunks and self.chunks[0][0] <= self.broken_at):
                raise StreamClosed(self.broken)  # what was still on the wire is lost with it
            if self.chunks:
                due, data = self.chunks[0]
                now = trio.current_time()
                if due <= now:
                    if len(data) <= n:
                        self.chunks.popleft()
                        return data
                    self.chunks[0] = (due, data[n:])
                    return data[:n]
                with trio.move_on_at(due):
                    await self.arrived.wait()
                continue
            if self.eof:
                return b""
            await self.arrived.wait()


class MemoryStream:
    """One end of an in-memory stream."""

    def __init__(self, hub: MemoryHub, link: _Link, inbound: _Pipe, outbound: _Pipe, local: str) -> None:
        self._hub, self._link, self._in, self._out, self._local = hub, link, inbound, outbound, local

    async def read(self, n: int) -> bytes:
        return await self._in.get(max(1, n))

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self._put(data)

    def _put(self, data: bytes) -> None:
        if self._out.broken or self._in.broken:
            raise StreamClosed(self._out.broken or self._in.broken)
        if self._out.eof:
            raise StreamClosed("write after close")
        if self._link.stalled or self._hub.swallows(self._link):
            self._link.stalled = True  # its bytes are gone: the stream never carries anything again
            return
        self._out.put(data)

    def detach(self) -> DetachedMemoryStream:
        return DetachedMemoryStream(self)

    async def close(self) -> None:
        self._out.close()
        await trio.lowlevel.checkpoint()

    async def reset(self) -> None:
        self._link.break_("the peer reset the stream")
        await trio.lowlevel.checkpoint()


class DetachedMemoryStream:
    """A `MemoryStream` off the event loop (`swarmd.net.seam.DetachedStream`): a task of the endpoint reads it."""

    def __init__(self, stream: MemoryStream) -> None:
        self._stream = stream
        self._closed = ""

    def start(self, reader: Reader) -> None:
        endpoint = self._stream._hub.endpoints.get(self._stream._local)
        if endpoint is None:
            reader.closed("the endpoint is gone")
            return
        endpoint._spawn(self._read, reader)

    def send(self, data: bytes, wait: float = 0.0) -> None:
        if self._closed:
            raise StreamClosed(self._closed)
        try:
            self._stream._put(data)
        except StreamClosed as e:
            self.close_now(str(e))
            raise

    def close_now(self, reason: str = "closed here") -> None:
        if not self._closed:
            self._closed = reason
            self._stream._link.break_(reason)

    async def _read(self, reader: Reader) -> None:
        reason = ""
        try:
            wait = reader.tick()
            while True:
                with trio.move_on_after(math.inf if wait is None else wait) as timer:
                    data = await self._stream.read(1 << 16)
                if timer.cancelled_caught:
                    wait = reader.tick()
                    continue
                if not data:
                    reason = "the peer closed the stream"
                    break
                reader.data(data)
                wait = reader.tick()
        except StreamClosed as e:
            reason = str(e)
        except Exception as e:  # a reader's bug: the link goes, the daemon stays (as with a thread)
            log.exception("a detached stream's reader failed")
            reason = f"reader failed: {type(e).__name__}: {e}"
        finally:  # a crash of the endpoint cancels this task: its links go with it
            self.close_now(reason or "the endpoint stopped")
            reader.closed(self._closed)


@dataclass(eq=False)
class _Link:
    """A stream between two endpoints: its two pipes."""

    a: str
    b: str
    a_to_b: _Pipe
    b_to_a: _Pipe
    relay: str = ""
    stalled: bool = False  # it lost bytes to a black hole or a hung peer, and stays silent

    def break_(self, reason: str) -> None:
        self.a_to_b.break_(reason)
        self.b_to_a.break_(reason)


@dataclass
class _Connection:
    relay: str = ""  # the peer relaying it, or "" for a direct connection
    dialer: str = ""


@dataclass
class MemoryHub:
    default_delay: float = 0.0
    gossip_loss: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    # (dialer, peer, protocol, the dialer's end) -> the stream the dialer uses
    wrap: Callable[[str, str, str, Stream], Stream] | None = None

    def __post_init__(self) -> None:
        self.endpoints: dict[str, MemoryNetwork] = {}
        self.down: set[str] = set()
        self.frozen: set[str] = set()  # hung processes (SIGSTOP): connections stay open, nothing moves
        self.natted: set[str] = set()
        self.refusing: set[str] = set()
        self.unserved: set[str] = set()
        self.group_of: dict[str, int] = {}
        self.delays: dict[Pair, float] = {}
        self.holes: set[Pair] = set()
        self.connections: dict[Pair, _Connection] = {}
        self.stream_opens: Counter[tuple[str, str]] = Counter()
        self._links: list[_Link] = []
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    def endpoint(self, peer_id: str, *, allow: frozenset[str] | None = None,
                 limits: GuardLimits | None = None) -> MemoryNetwork:
        """A (fresh) endpoint for `peer_id`: a peer starting, or a crashed one starting again."""
        old = self.endpoints.get(peer_id)
        if old is not None:
            self.crash(peer_id)
        self.down.discard(peer_id)
        self.frozen.discard(peer_id)
        net = MemoryNetwork(self, peer_id, allow=allow, limits=limits)
        self.endpoints[peer_id] = net
        return net

    # --- the state of the wire --------------------------------------------------------------------------
    def up(self, peer: str) -> bool:
        return peer in self.endpoints and peer not in self.down

    def same_side(self, a: str, b: str) -> bool:
        return self.group_of.get(a, 0) == self.group_of.get(b, 0)

    def reachable(self, a: str, b: str) -> bool:
        return self.up(a) and self.up(b) and self.same_side(a, b)

    def delay(self, a: str, b: str) -> float:
        return self.delays.get(pair(a, b), self.default_delay)

    def swallows(self, link: _Link) -> bool:
        """Do bytes written on `link` vanish now (a black hole on the way, or a hung end)?"""
        ends = {link.a, link.b}
        if ends & self.frozen or (link.relay and link.relay in self.frozen):
            return True
        hops = [pair(link.a, link.b)] if not link.relay else [pair(link.a, link.relay), pair(link.relay, link.b)]
        return any(h in self.holes for h in hops)

    def connected(self, a: str, b: str) -> bool:
        return pair(a, b) in self.connections

    # --- faults -----------------------------------------------------------------------------------------
    def set_delay(self, a: str, b: str, seconds: float) -> None:
        self.delays[pair(a, b)] = seconds

    def freeze(self, peer_id: str) -> None:
        """The peer hangs: no gossip to or from it, dials to it never finish, its streams stall."""
        self.frozen.add(peer_id)

    def thaw(self, peer_id: str) -> None:
        self.frozen.discard(peer_id)

    def crash(self, peer_id: str) -> None:
        self.down.add(peer_id)
        self._cut(lambda a, b, relay: peer_id in (a, b, relay), f"{peer_id[-6:]} crashed")

    def partition(self, *groups: Sequence[str]) -> None:
        self.group_of = {p: i + 1 for i, g in enumerate(groups) for p in g}
        self._cut(lambda a, b, relay: not self.same_side(a, b) or (bool(relay) and not (
            self.same_side(a, relay) and self.same_side(relay, b))), "partitioned")

    def heal(self) -> None:
        self.group_of = {}

    def hang_up(self, a: str, b: str) -> None:
        """Close the connection between `a` and `b` and every stream on it."""
        self._cut(lambda x, y, relay: {x, y} == {a, b}, "connection closed")

    def reset(self, a: str | None = None, b: str | None = None) -> None:
        """Break the streams between `a` and `b` (every stream, if neither is given); connections stay."""
        for link in list(self._links):
            if a is None or {link.a, link.b} == {a, b}:
                link.break_("stream reset")
        self._links = [k for k in self._links if not k.a_to_b.broken]

    def black_hole(self, a: str, b: str) -> None:
        self.holes.add(pair(a, b))

    def mend(self, a: str, b: str) -> None:
        self.holes.discard(pair(a, b))

    def behind_nat(self, peer_id: str) -> None:
        self.natted.add(peer_id)

    def refuse_dials(self, peer_id: str, refuse: bool = True) -> None:
        (self.refusing.add if refuse else self.refusing.discard)(peer_id)

    def serve_nothing(self, peer_id: str, unserved: bool = True) -> None:
        """Streams opened to `peer_id` open, and nobody ever reads or answers them."""
        (self.unserved.add if unserved else self.unserved.discard)(peer_id)

    # --- connections and streams -------------------------------------------------------------------------
    def _relay_for(self, dialer: str, target: str) -> str | None:
        """A dialable peer connected to `target` that `dialer` can reach: the relay a NATed peer is dialled
        through (every reachable member serves as a relay)."""
        for relay in sorted(self.endpoints):
            if relay in (dialer, target) or relay in self.natted or not self.up(relay):
                continue
            if self.connected(relay, target) and self.same_side(dialer, relay) and self.same_side(relay, target):
                return relay
        return None

    def _connect(self, dialer: str, target: str) -> _Connection:
        key = pair(dialer, target)
        conn = self.connections.get(key)
        if conn is not None:
            return conn
        if target in self.refusing or not self.reachable(dialer, target):
            raise PeerUnreachable("connection refused")
        relay = ""
        if target in self.natted:
            found = self._relay_for(dialer, target)
            if found is None:
                raise PeerUnreachable("the peer is behind a NAT and no relay reaches it")
            relay = found
        conn = self.connections[key] = _Connection(relay, dialer)
        for peer in (dialer, target):
            self.endpoints[peer].on_connected()
        return conn

    def _open(self, dialer: str, target: str) -> tuple[MemoryStream, MemoryStream]:
        conn = self.connections[pair(dialer, target)]
        delay = self.delay(dialer, conn.relay) + self.delay(conn.relay, target) if conn.relay else \
            self.delay(dialer, target)
        link = _Link(dialer, target, _Pipe(delay), _Pipe(delay), conn.relay)
        self._links.append(link)
        self.stream_opens[(dialer, target)] += 1
        return (MemoryStream(self, link, link.b_to_a, link.a_to_b, dialer),
                MemoryStream(self, link, link.a_to_b, link.b_to_a, target))

    def _cut(self, broken: Callable[[str, str, str], bool], reason: str) -> None:
        for key, conn in list(self.connections.items()):
            a, b = sorted(key)
            if broken(a, b, conn.relay):
                del self.connections[key]
                for peer, other in ((a, b), (b, a)):
                    net = self.endpoints.get(peer)
                    if net is not None:
                        net.on_disconnected(other)
        keep = []
        for link in self._links:
            if broken(link.a, link.b, link.relay):
                link.break_(reason)
            elif not link.a_to_b.broken:
                keep.append(link)
        self._links = keep

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._nursery is not None, "start the hub first: await nursery.start(hub.run)"
        self._nursery.start_soon(fn, *args)


class MemoryNetwork:
    """One peer's view of the hub; implements `swarmd.net.seam.Network`."""

    def __init__(self, hub: MemoryHub, peer_id: str, *, allow: frozenset[str] | None = None,
                 limits: GuardLimits | None = None) -> None:
        self.hub = hub
        self._peer_id = peer_id
        self.gate = PeerGate(allow, limits, self_id=peer_id, on_penalised=self._on_penalised)
        self.guard = StreamGuard(self.gate)
        self._subs: dict[str, list[trio.MemorySendChannel[GossipMessage]]] = {}
        self._handlers: dict[str, StreamHandler] = {}
        self._disconnect_send, self._disconnect_recv = trio.open_memory_channel[str](256)
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve this endpoint's streams until cancelled; leaving takes the endpoint down as a crash would."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            if self.hub.endpoints.get(self._peer_id) is self:
                self.hub.crash(self._peer_id)

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def connections(self) -> set[str]:
        return {next(iter(key - {self._peer_id})) for key in self.hub.connections if self._peer_id in key}

    def addresses(self) -> list[str]:
        return [f"/memory/{self._peer_id}/p2p/{self._peer_id}"]

    def bound_addresses(self) -> list[str]:
        return self.addresses()

    # --- gossip -------------------------------------------------------------------------------------------
    async def publish(self, topic: str, data: bytes) -> None:
        """Gossip relays: every endpoint connected to us through any chain of connections gets it."""
        now = trio.current_time()
        hub = self.hub
        for other in sorted(self._component() - {self._peer_id}):
            net = hub.endpoints[other]
            if not net.gate.admits(self._peer_id, now) or (hub.gossip_loss and hub.rng.random() < hub.gossip_loss):
                continue
            delay = hub.delay(self._peer_id, other)
            if delay > 0:
                hub.spawn(net._deliver_later, topic, GossipMessage(self._peer_id, data), now + delay)
            else:
                net._deliver(topic, GossipMessage(self._peer_id, data))
        await trio.lowlevel.checkpoint()

    def _deliver(self, topic: str, msg: GossipMessage) -> None:
        if not self.hub.up(self._peer_id) or self._peer_id in self.hub.frozen:
            return
        for ch in self._subs.get(topic, []):
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                ch.send_nowait(msg)

    async def _deliver_later(self, topic: str, msg: GossipMessage, at: float) -> None:
        await trio.sleep_until(at)
        if self.hub.endpoints.get(self._peer_id) is self:
            self._deliver(topic, msg)

    def _component(self) -> set[str]:
        hub = self.hub
        if not hub.up(self._peer_id) or self._peer_id in hub.frozen:
            return set()
        seen, todo = {self._peer_id}, [self._peer_id]
        while todo:
            for nxt in hub.endpoints[todo.pop()].connections:
                if nxt not in seen and nxt not in hub.frozen and hub.reachable(self._peer_id, nxt):
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    async def subscribe(self, topic: str) -> trio.MemoryReceiveChannel[GossipMessage]:
        send, recv = trio.open_memory_channel[GossipMessage](1024)
        self._subs.setdefault(topic, []).append(send)
        return recv

    # --- connections -------------------------------------------------------------------------------------
    async def connect(self, peer_id: str, addresses: Sequence[str] = ()) -> None:
        await trio.lowlevel.checkpoint()
        hub = self.hub
        if peer_id in hub.frozen and not hub.connected(self._peer_id, peer_id):
            await trio.sleep_forever()  # the kernel accepts, the process never answers the handshake
        now = trio.current_time()
        if hub.up(peer_id):
            refusal = self.gate.refusal(peer_id, now) or hub.endpoints[peer_id].gate.refusal(self._peer_id, now)
            if refusal is not None:
                raise PeerUnreachable(f"connection refused: {refusal}")
        hub._connect(self._peer_id, peer_id)

    def is_connected(self, peer_id: str) -> bool:
        return self.hub.connected(self._peer_id, peer_id)

    def connected_peers(self) -> list[str]:
        return sorted(self.connections)

    def is_relayed(self, peer_id: str) -> bool:
        conn = self.hub.connections.get(pair(self._peer_id, peer_id))
        return conn is not None and bool(conn.relay)

    def on_connected(self) -> None:
        return None

    def on_disconnected(self, peer_id: str) -> None:
        with contextlib.suppress(trio.WouldBlock):
            self._disconnect_send.send_nowait(peer_id)

    def disconnects(self) -> trio.MemoryReceiveChannel[str]:
        return self._disconnect_recv

    def hang_up(self, peer_id: str) -> None:
        self.hub.hang_up(self._peer_id, peer_id)

    def strike(self, peer_id: str, reason: str) -> None:
        self.gate.strike(peer_id, trio.current_time(), reason)

    def _on_penalised(self, peer_id: str, reason: str) -> None:
        log.warning("%s cuts off %s: %s", self._peer_id[-6:], peer_id[-6:], reason)
        self._spawn(self._hang_up_later, peer_id)

    async def _hang_up_later(self, peer_id: str) -> None:
        await trio.sleep(HANG_UP_DELAY)  # as the libp2p network does: the peer can read why first
        self.hub.hang_up(self._peer_id, peer_id)

    # --- streams -----------------------------------------------------------------------------------------
    async def open_stream(self, peer_id: str, protocol: str, *, bulk: bool = False) -> Stream:
        await self.connect(peer_id)
        hub = self.hub
        target = hub.endpoints[peer_id]
        handler = target._handlers.get(protocol)
        if handler is None:
            raise PeerUnreachable(f"{peer_id[-6:]} does not speak {protocol}")
        mine, theirs = hub._open(self._peer_id, peer_id)
        if peer_id not in hub.unserved:
            target._spawn(target._serve_one, handler, protocol, theirs)
        return hub.wrap(self._peer_id, peer_id, protocol, mine) if hub.wrap is not None else mine

    def serve(self, protocol: str, handler: StreamHandler, *, bulk: bool = False) -> None:
        self._handlers[protocol] = self.guard.wrap(protocol, handler, long_lived=bulk)

    def link_paths(self) -> dict[str, LinkInfo]:
        out = {}
        for key, conn in self.hub.connections.items():
            if self._peer_id in key:
                other = next(iter(key - {self._peer_id}))
                out[other] = LinkInfo(LinkPath.RELAYED, f"through {conn.relay[-6:]}") if conn.relay else \
                    LinkInfo(LinkPath.MEMORY, "in-memory twin")
        return out

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)
        else:  # an endpoint a test drives without running it
            self.hub.spawn(fn, *args)

    async def _serve_one(self, handler: StreamHandler, protocol: str, stream: MemoryStream) -> None:
        remote = stream._link.a
        try:
            await handler(remote, stream)
        except StreamClosed:
            pass
        except Exception as e:
            log.warning("handler for %s failed: %s", protocol, e)
        finally:
            with contextlib.suppress(Exception):
                await stream.close()
