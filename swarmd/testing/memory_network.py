"""The in-memory twin of the network seam, for fast tests in virtual time.

One `MemoryHub` stands for the wire: gossip reaches every subscribed endpoint connected to the
publisher through some chain of connections (as gossipsub relays), streams
are trio memory stream pairs, and the test can crash an endpoint or cut the hub into partitions
(existing connections across the cut close, as TCP would). Each endpoint has the daemon's peer gate and
stream guard (allowlist, penalties, rates, read timeouts), as the libp2p network has. Nothing here is used
by the daemon.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import trio
import trio.testing

from swarmd.net.gate import GuardLimits, PeerGate
from swarmd.net.seam import GossipMessage, PeerUnreachable, Stream, StreamClosed, StreamHandler
from swarmd.net.stream_guard import StreamGuard

log = logging.getLogger("swarmd.memnet")


class _MemoryStream:
    def __init__(self, send: trio.testing.MemorySendStream, receive: trio.testing.MemoryReceiveStream,
                 stalled: Callable[[], bool] = lambda: False) -> None:
        self._send, self._receive = send, receive
        self._stalled = stalled  # a frozen peer on either end: bytes written vanish, as into a full window

    async def read(self, n: int = -1) -> bytes:
        return await self._receive.receive_some(n if n > 0 else None)

    async def write(self, data: bytes) -> None:
        if self._stalled():
            await trio.lowlevel.checkpoint()
            return
        await self._send.send_all(data)

    async def close(self) -> None:
        self.break_()
        await trio.lowlevel.checkpoint()

    async def reset(self) -> None:
        await self.close()

    def break_(self) -> None:
        self._send.close()
        self._receive.close()


def _stream_pair(stalled: Callable[[], bool]) -> tuple[_MemoryStream, _MemoryStream]:
    a_send, b_receive = trio.testing.memory_stream_one_way_pair()
    b_send, a_receive = trio.testing.memory_stream_one_way_pair()
    return _MemoryStream(a_send, a_receive, stalled), _MemoryStream(b_send, b_receive, stalled)


class MemoryHub:
    def __init__(self) -> None:
        self.endpoints: dict[str, MemoryNetwork] = {}
        self.down: set[str] = set()
        self.frozen: set[str] = set()  # hung processes (SIGSTOP): connections stay open, nothing moves
        self.group_of: dict[str, int] = {}
        self.relayed: set[frozenset[str]] = set()  # pairs connected only through a circuit relay
        self._streams: list[tuple[str, str, _MemoryStream, _MemoryStream]] = []
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    def endpoint(self, peer_id: str, *, allow: frozenset[str] | None = None,
                 limits: GuardLimits | None = None) -> MemoryNetwork:
        """A (fresh) endpoint for `peer_id`; a crashed peer comes back up through this."""
        self.down.discard(peer_id)
        net = MemoryNetwork(self, peer_id, allow=allow, limits=limits)
        self.endpoints[peer_id] = net
        return net

    def reachable(self, a: str, b: str) -> bool:
        return (a not in self.down and b not in self.down and a in self.endpoints and b in self.endpoints
                and self.group_of.get(a, 0) == self.group_of.get(b, 0))

    def freeze(self, peer_id: str) -> None:
        """The peer hangs: no gossip to or from it, dials to it never finish, its streams stall."""
        self.frozen.add(peer_id)

    def thaw(self, peer_id: str) -> None:
        self.frozen.discard(peer_id)

    def crash(self, peer_id: str) -> None:
        self.down.add(peer_id)
        self._cut(lambda a, b: peer_id in (a, b))

    def partition(self, *groups: Sequence[str]) -> None:
        self.group_of = {p: i + 1 for i, g in enumerate(groups) for p in g}
        self._cut(lambda a, b: not self.reachable(a, b))

    def heal(self) -> None:
        self.group_of = {}

    def hang_up(self, a: str, b: str) -> None:
        """Close the connection between `a` and `b` (as a penalty does)."""
        self._cut(lambda x, y: {x, y} == {a, b})

    def _cut(self, broken) -> None:
        for a, net in list(self.endpoints.items()):
            for b in list(net.connections):
                if broken(a, b):
                    net.connections.discard(b)
                    with contextlib.suppress(trio.WouldBlock):
                        net._disconnect_send.send_nowait(b)
        keep = []
        for a, b, sa, sb in self._streams:
            if broken(a, b):
                for s in (sa, sb):
                    with contextlib.suppress(Exception):
                        s.break_()
            else:
                keep.append((a, b, sa, sb))
        self._streams = keep

    def _spawn(self, fn, *args) -> None:
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
        self.connections: set[str] = set()
        self._subs: dict[str, list[trio.MemorySendChannel[GossipMessage]]] = {}
        self._handlers: dict[str, StreamHandler] = {}
        self._disconnect_send, self._disconnect_recv = trio.open_memory_channel[str](256)

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def addresses(self) -> list[str]:
        return [f"/memory/{self._peer_id}"]

    async def publish(self, topic: str, data: bytes) -> None:
        """Gossip relays: every endpoint connected to us through any chain of connections gets it."""
        now = trio.current_time()
        for other in self._component() - {self._peer_id}:
            if not self.hub.endpoints[other].gate.admits(self._peer_id, now):
                continue
            for ch in self.hub.endpoints[other]._subs.get(topic, []):
                with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                    ch.send_nowait(GossipMessage(self._peer_id, data))
        await trio.lowlevel.checkpoint()

    def _component(self) -> set[str]:
        if self._peer_id in self.hub.down or self._peer_id in self.hub.frozen:
            return set()
        seen, todo = {self._peer_id}, [self._peer_id]
        while todo:
            for nxt in self.hub.endpoints[todo.pop()].connections:
                if nxt not in seen and nxt not in self.hub.frozen and self.hub.reachable(self._peer_id, nxt):
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    async def subscribe(self, topic: str) -> trio.MemoryReceiveChannel[GossipMessage]:
        send, recv = trio.open_memory_channel[GossipMessage](1024)
        self._subs.setdefault(topic, []).append(send)
        return recv

    async def connect(self, peer_id: str, addresses: Sequence[str]) -> None:
        await trio.lowlevel.checkpoint()
        if peer_id in self.hub.frozen and peer_id not in self.connections:
            await trio.sleep_forever()  # the kernel accepts, the process never answers the handshake
        if not self.hub.reachable(self._peer_id, peer_id):
            raise PeerUnreachable("connection refused")
        now = trio.current_time()
        refusal = self.gate.refusal(peer_id, now) or self.hub.endpoints[peer_id].gate.refusal(self._peer_id, now)
        if refusal is not None:
            raise PeerUnreachable(f"connection refused: {refusal}")
        self.connections.add(peer_id)
        self.hub.endpoints[peer_id].connections.add(self._peer_id)

    def is_connected(self, peer_id: str) -> bool:
        return peer_id in self.connections

    def connected_peers(self) -> list[str]:
        return sorted(self.connections)

    def is_relayed(self, peer_id: str) -> bool:
        return frozenset((self._peer_id, peer_id)) in self.hub.relayed

    async def open_stream(self, peer_id: str, protocol: str) -> Stream:
        await self.connect(peer_id, ())
        target = self.hub.endpoints[peer_id]
        handler = target._handlers.get(protocol)
        if handler is None:
            raise PeerUnreachable(f"{peer_id[-6:]} does not speak {protocol}")
        pair = {self._peer_id, peer_id}
        mine, theirs = _stream_pair(lambda: bool(pair & self.hub.frozen))
        self.hub._streams.append((self._peer_id, peer_id, mine, theirs))
        self.hub._spawn(self._guarded, handler, protocol, theirs)
        return mine

    async def _guarded(self, handler: StreamHandler, protocol: str, stream: _MemoryStream) -> None:
        try:
            await handler(self._peer_id, stream)
        except (StreamClosed, trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        except Exception as e:
            log.warning("handler for %s failed: %s", protocol, e)
        finally:
            with contextlib.suppress(Exception):
                await stream.close()

    def serve(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = self.guard.wrap(protocol, handler)

    def disconnects(self) -> trio.MemoryReceiveChannel[str]:
        return self._disconnect_recv

    def hang_up(self, peer_id: str) -> None:
        self.hub.hang_up(self._peer_id, peer_id)

    def strike(self, peer_id: str, reason: str) -> None:
        self.gate.strike(peer_id, trio.current_time(), reason)

    def _on_penalised(self, peer_id: str, reason: str) -> None:
        log.warning("%s cuts off %s: %s", self._peer_id[-6:], peer_id[-6:], reason)
        self.hub.hang_up(self._peer_id, peer_id)
