"""A link emulator: a TCP proxy that adds delay, jitter, a bandwidth cap, resets and black-holes.

The kernel on our machines has no netem, so WAN conditions between daemons are emulated here: a
daemon is told (with `--announce`) to have peers dial the emulator's port, and the emulator forwards
to the daemon's real port. Every setting can change while connections are open.

    link = Link(LinkConfig(delay_ms=10, bandwidth_mbit=100), target=("127.0.0.1", 4001))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(link.serve)
        link.update(delay_ms=50)       # takes effect for bytes read from now on
        link.reset_connections()       # abrupt RST on every open connection
"""

from __future__ import annotations

import json
import random
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import trio

CHUNK = 64 * 1024
MAX_BUFFERED = 4 * 1024 * 1024  # bytes in flight per direction before the reader stops reading (backpressure)


@dataclass(frozen=True)
class LinkConfig:
    delay_ms: float = 0.0  # one way, each direction
    jitter_ms: float = 0.0  # uniform in [-jitter, +jitter], never reorders bytes
    bandwidth_mbit: float = 0.0  # per direction; 0 = unlimited
    reset_probability: float = 0.0  # chance per forwarded chunk that the connection is reset
    blackhole: bool = False  # hold every byte (connections stay open, nothing arrives)

    def one_way_delay(self, rng: random.Random) -> float:
        jitter = rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        return max(0.0, self.delay_ms + jitter) / 1e3

    def transmit_time(self, nbytes: int) -> float:
        return nbytes * 8 / (self.bandwidth_mbit * 1e6) if self.bandwidth_mbit > 0 else 0.0


@dataclass
class LinkStats:
    connections: int = 0
    resets: int = 0
    bytes_forwarded: int = 0


def _abort(stream: trio.SocketStream) -> None:
    """Close with SO_LINGER 0, so the peer sees a TCP RST rather than a clean FIN."""
    try:
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    stream.socket.close()


@dataclass(eq=False)  # hashed by identity: kept in a set of open connections
class _Connection:
    client: trio.SocketStream
    upstream: trio.SocketStream
    cancel: trio.CancelScope = field(default_factory=trio.CancelScope)

    def abort(self) -> None:
        _abort(self.client)
        _abort(self.upstream)
        self.cancel.cancel()


class Link:
    """One emulated link: listens on a loopback port and forwards to `target`."""

    def __init__(self, config: LinkConfig, target: tuple[str, int], *, seed: int = 0) -> None:
        self.config = config
        self.target = target
        self.stats = LinkStats()
        self._rng = random.Random(seed)
        self._open: set[_Connection] = set()
        self._config_changed = trio.Event()

    def update(self, **changes: Any) -> LinkConfig:
        self.config = replace(self.config, **changes)
        self._config_changed.set()
        self._config_changed = trio.Event()
        return self.config

    def reset_connections(self) -> int:
        """Reset every open connection now; returns how many."""
        conns = list(self._open)
        for conn in conns:
            conn.abort()
        self.stats.resets += len(conns)
        return len(conns)

    async def serve(self, *, host: str = "127.0.0.1", port: int = 0,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(bound)
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, client: trio.SocketStream) -> None:
        try:
            upstream = await trio.open_tcp_stream(*self.target)
        except OSError:
            _abort(client)
            return
        conn = _Connection(client, upstream)
        self._open.add(conn)
        self.stats.connections += 1
        try:
            with conn.cancel:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, conn, client, upstream)
                    nursery.start_soon(self._pump, conn, upstream, client)
        finally:
            self._open.discard(conn)
            for s in (client, upstream):
                try:
                    s.socket.close()
                except OSError:
                    pass

    async def _pump(self, conn: _Connection, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        """Read from src, deliver to dst after the configured delay, paced to the bandwidth, in order."""
        queue: deque[tuple[float, bytes]] = deque()
        buffered = 0
        space = trio.Condition()
        arrived = trio.Condition()
        eof = False

        async def read() -> None:
            nonlocal buffered, eof
            while True:
                async with space:
                    while buffered >= MAX_BUFFERED:
                        await space.wait()
                try:
                    data = await src.receive_some(CHUNK)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    data = b""
                if not data:
                    eof = True
                    async with arrived:
                        arrived.notify_all()
                    return
                if self._rng.random() < self.config.reset_probability:
                    self.stats.resets += 1
                    conn.abort()
                    return
                queue.append((trio.current_time() + self.config.one_way_delay(self._rng), data))
                buffered += len(data)
                async with arrived:
                    arrived.notify_all()

        async def write() -> None:
            nonlocal buffered
            next_free = trio.current_time()  # when the emulated wire is free to send again
            while True:
                async with arrived:
                    while not queue and not eof:
                        await arrived.wait()
                if not queue:
                    try:
                        await dst.send_eof()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                    return
                due, data = queue[0]
                while self.config.blackhole:
                    await self._config_changed.wait()
                await trio.sleep_until(max(due, next_free))
                next_free = max(due, next_free) + self.config.transmit_time(len(data))
                await trio.sleep_until(next_free)
                queue.popleft()
                buffered -= len(data)
                async with space:
                    space.notify_all()
                try:
                    await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    conn.cancel.cancel()
                    return
                self.stats.bytes_forwarded += len(data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(write)


def json_lines_handler(answer: Callable[[Any], dict[str, Any]]) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """A control connection's handler: each line a JSON command, each answered by one JSON line (`answer`'s
    reply, or {"error": ...} for a line that is not a command `answer` takes)."""

    async def handle(stream: trio.SocketStream) -> None:
        buf = b""
        async with stream:
            async for data in stream:
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        reply = answer(json.loads(line))
                    except (ValueError, TypeError) as e:
                        reply = {"error": str(e)}
                    await stream.send_all(json.dumps(reply).encode() + b"\n")

    return handle
