"""Fetching chunks into a partial model from the peers that hold them: the trio driver of `FetchState`.

One task per source: it opens a `/swarmd/weights/1.0.0` stream through the network seam, asks which chunks
the peer holds, then keeps a window of requests in flight, asking `FetchState` which chunks to request
next, and reads the answers while a second task checks and writes the chunks already read. Each chunk is checked against the manifest (in a worker thread) before it is written; a bad one
strikes its sender (`Network.strike`) and bans it from this fetch, and its chunks go to other sources. A
lost source is retried with backoff while it is a member. Peers reached only through a relay are skipped
(`swarmd.weights.relay_rule`). What is written is flushed to disk every second, so a restart resumes.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from models.catalog.chunk_store import PartialModel
from models.errors import ModelError
from swarmd.errors import RemoteProtocolError
from swarmd.net.identity import short_id
from swarmd.net.seam import Network, PeerUnreachable, Stream, StreamClosed
from swarmd.net.streams import read_frame, write_frame
from swarmd.weights.fetch import (
    Arrived,
    Corrupt,
    FetchAction,
    FetchState,
    Offered,
    Refused,
    SourceLost,
    SourceState,
    Strike,
)
from swarmd.weights.progress import FetchProgress
from swarmd.weights.protocol import (
    MAX_CHUNKS_PER_GET,
    PROTOCOL,
    ChunkReply,
    GetRequest,
    HeldReply,
    HeldRequest,
    Refusal,
    bits_to_chunks,
    decode_reply,
    encode,
)
from swarmd.weights.relay_rule import may_carry_weights

log = logging.getLogger("swarmd.weights")

REPLY_OVERHEAD = 1024  # what a frame carries besides a chunk's bytes
WRITE_QUEUE = 8  # chunks read from one source and waiting to be checked and written
FLUSH_INTERVAL = 1.0


class Fetcher:
    def __init__(self, network: Network, store: PartialModel, sources: Callable[[], Sequence[str]], *,
                 progress: FetchProgress | None = None, window_bytes: int = 4 << 20, max_pending: int = 64,
                 refresh_s: float = 2.0, retry_s: float = 0.5, retry_max_s: float = 8.0,
                 blocking: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync) -> None:
        self.network = network
        self.store = store
        self.blocking = blocking  # disk writes and hashing, off the event loop
        self.sources = sources  # members that may hold chunks of the model, asked anew every refresh
        self.progress = progress or FetchProgress()
        self.window_bytes = window_bytes
        self.max_pending = max_pending
        self.refresh_s = refresh_s
        self.retry_s, self.retry_max_s = retry_s, retry_max_s
        self.stats: Counter[str] = Counter()
        self.bytes_from: Counter[str] = Counter()
        self._state = FetchState({})
        self._changed = trio.Event()
        self._running: set[str] = set()
        self._retry: dict[str, tuple[float, float]] = {}  # peer -> (not before, last delay)
        self._relayed: set[str] = set()

    async def fetch(self, chunks: Sequence[int]) -> None:
        """Fetch those of `chunks` not held yet; return once all are held and on disk. Waits for sources as long
        as it takes (the caller cancels it when the assignment changes)."""
        manifest = self.store.manifest
        wanted = {i: manifest.chunks[i].length for i in chunks}
        self._state = state = FetchState(wanted, held=[i for i in wanted if self.store.has(i)])
        if state.done:
            return
        self.progress.start(state.bytes_total - state.bytes_held, trio.current_time())
        log.info("fetching %.1f MiB of weights (%d chunks) from the swarm", (state.bytes_total - state.bytes_held)
                 / 2**20, sum(1 for i in wanted if not self.store.has(i)))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._flush_now_and_then)
                while not state.done:
                    self._start_sources(nursery)
                    self.progress.sources = len(self._running)
                    self.progress.waiting = self._why_waiting()
                    with trio.move_on_after(self.refresh_s):
                        await self._changed.wait()
                nursery.cancel_scope.cancel()
        finally:  # done, or cancelled (the plan moved on): what arrived is kept, and the progress is over
            with trio.CancelScope(shield=True):
                await self.blocking(self.store.flush)
            self.progress.finish(trio.current_time())
            self.progress.sources, self.progress.waiting = 0, ""
        now = trio.current_time()
        log.info("fetched %.1f MiB of weights in %.1f s (%.1f MiB/s) from %s", self.progress.done / 2**20,
                 now - self.progress.started, self.progress.rate(now) / 2**20,
                 ", ".join(f"{short_id(p)} {n / 2**20:.1f} MiB" for p, n in sorted(self.bytes_from.items())))

    # --- sources --------------------------------------------------------------------------------------------
    def _start_sources(self, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        for peer in self.sources():
            if peer == self.network.peer_id or peer in self._running:
                continue
            if self._state.sources.get(peer) is SourceState.BANNED or self._retry.get(peer, (0.0, 0.0))[0] > now:
                continue
            if not may_carry_weights(self.network, peer):
                if peer not in self._relayed:
                    log.info("not fetching from %s: it is reached through a relay", short_id(peer))
                self._relayed.add(peer)
                continue
            self._relayed.discard(peer)
            self._running.add(peer)
            nursery.start_soon(self._source, peer)

    def _why_waiting(self) -> str:
        state = self._state
        lacking = state.unsourced()
        if not lacking or state.done:
            return ""
        why = f"{len(lacking)} chunks have no source"
        if self._relayed:
            why += f" ({len(self._relayed)} holder(s) reached only through a relay)"
        return why

    async def _source(self, peer: str) -> None:
        """Fetch from `peer` until the fetch is done, the peer is lost, or it sends a bad chunk: one task reads its
        answers, another checks and writes the chunks (so the next chunk is read while one is hashed)."""
        stream: Stream | None = None
        lost = ""
        try:
            stream = await self.network.open_stream(peer, PROTOCOL, bulk=True)
            await self._offer(peer, stream)
            send, receive = trio.open_memory_channel[tuple[int, bytes]](WRITE_QUEUE)
            async with trio.open_nursery() as inner:
                inner.start_soon(self._write, peer, receive, inner.cancel_scope)
                lost = await self._read(peer, stream, send)
        except (PeerUnreachable, StreamClosed) as e:
            lost = str(e)
        except RemoteProtocolError as e:
            self._apply([Strike(peer, f"weights: {e}")])
            lost = str(e)
        finally:
            self._running.discard(peer)
            if stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await _reset(stream)
            self._notify()
        if lost:
            self._lost(peer, lost)

    async def _read(self, peer: str, stream: Stream, send: trio.MemorySendChannel[tuple[int, bytes]]) -> str:
        """Ask `peer` for chunks and hand what arrives to the writer; why it stopped ("" when the fetch is done)."""
        state = self._state
        offered_at = trio.current_time()
        pending: deque[int] = deque()
        async with send:
            try:
                while not state.done:
                    await self._ask_more(peer, stream, pending)
                    if not pending:
                        if state.unsourced() and trio.current_time() - offered_at >= self.refresh_s:
                            await self._offer(peer, stream)  # a partial holder may hold more by now
                            offered_at = trio.current_time()
                            continue
                        with trio.move_on_after(self.refresh_s):
                            await self._changed.wait()
                        continue
                    reply = decode_reply(await read_frame(stream, self.store.manifest.chunk_bytes + REPLY_OVERHEAD))
                    if isinstance(reply, Refusal) and reply.index is None:
                        raise StreamClosed(f"refused: {reply.reason}")
                    if not isinstance(reply, ChunkReply | Refusal) or reply.index != pending[0]:
                        raise RemoteProtocolError(f"answered chunk {pending[0]} with {type(reply).__name__}")
                    index = pending.popleft()
                    if isinstance(reply, Refusal):
                        self.stats["chunks_refused"] += 1
                        self._state.handle(Refused(peer, index))
                        self._notify()
                    else:
                        await send.send((index, reply.data))
            except (PeerUnreachable, StreamClosed) as e:
                return str(e)
            except RemoteProtocolError as e:
                self._apply([Strike(peer, f"weights: {e}")])
                return str(e)
        return ""

    async def _write(self, peer: str, receive: trio.MemoryReceiveChannel[tuple[int, bytes]],
                     scope: trio.CancelScope) -> None:
        """Check each chunk against the manifest and write it; a bad one bans `peer` and stops its reader."""
        async with receive:
            async for index, data in receive:
                try:
                    await self.blocking(self.store.write, index, data)
                except ModelError as e:
                    self.stats["bad_chunks"] += 1
                    log.warning("%s sent a bad chunk %d: %s; fetching it elsewhere", short_id(peer), index, e)
                    self._apply(self._state.handle(Corrupt(peer, index, str(e))))
                    self._notify()
                    scope.cancel()
                    return
                self._state.handle(Arrived(peer, index))
                self._retry.pop(peer, None)
                self.stats["chunks_fetched"] += 1
                self.stats["bytes_fetched"] += len(data)
                self.bytes_from[peer] += len(data)
                self.progress.add(len(data), trio.current_time())
                self._notify()

    async def _offer(self, peer: str, stream: Stream) -> None:
        await write_frame(stream, encode(HeldRequest(self.store.digest)))
        reply = decode_reply(await read_frame(stream, len(self.store.manifest.chunks) // 8 + REPLY_OVERHEAD))
        if isinstance(reply, Refusal):
            raise StreamClosed(f"refused: {reply.reason}")
        if not isinstance(reply, HeldReply):
            raise RemoteProtocolError("answered a held request with something else")
        self._state.handle(Offered(peer, bits_to_chunks(reply.bits, len(self.store.manifest.chunks))))
        self._notify()

    async def _ask_more(self, peer: str, stream: Stream, pending: deque[int]) -> None:
        """Fill the window of requests in flight to `peer`."""
        sizes = self._state.sizes
        room = self.window_bytes - sum(sizes[i] for i in pending)
        if room <= 0:
            return
        chunk = self.store.manifest.chunk_bytes  # the window is filled, its last chunk may pass its end
        batch = self._state.take(peer, min(self.max_pending - len(pending), MAX_CHUNKS_PER_GET, -(-room // chunk)))
        pending.extend(batch)
        if batch:
            await write_frame(stream, encode(GetRequest(self.store.digest, tuple(batch))))

    def _lost(self, peer: str, reason: str) -> None:
        self.stats["sources_lost"] += 1
        _, last = self._retry.get(peer, (0.0, 0.0))
        delay = min(self.retry_max_s, max(self.retry_s, 2 * last))
        self._retry[peer] = (trio.current_time() + delay, delay)
        if self._state.sources.get(peer) is SourceState.ACTIVE:
            log.info("lost weights source %s (%s); retrying it in %.1f s, fetching from the others", short_id(peer),
                     reason, delay)
        self._apply(self._state.handle(SourceLost(peer, reason)))

    def _apply(self, actions: list[FetchAction]) -> None:
        for a in actions:
            if isinstance(a, Strike):
                self.network.strike(a.peer, a.reason)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _flush_now_and_then(self) -> None:
        while True:
            await trio.sleep(FLUSH_INTERVAL)
            await self.blocking(self.store.flush)


async def _reset(stream: Stream) -> None:
    try:
        await stream.reset()
    except Exception:
        return
