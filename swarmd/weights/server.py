"""Serving the weights this daemon holds to peers that ask (`swarmd.weights.protocol`).

Streams are `bulk` (the libp2p network carries them on its TLS data plane, at several times a libp2p stream's
rate), served under the network's stream guard (rates, strikes for bad frames); as the guard leaves bulk
streams' liveness to their protocol, the server closes a stream idle for `IDLE_TIMEOUT_S` and answers at most
`STREAMS_PER_PEER` at once from one peer. A peer reached through a relay is refused
(`swarmd.weights.relay_rule`). Chunks go out paced by one `Pacer`
for all streams: at most `rate` bytes per second, and `busy_rate` while requests run through this daemon,
so that activations keep priority over weights. A partial model serves what it has fetched so far.

`SWARMD_TEST_CORRUPT_CHUNKS=1` in a daemon's environment makes its server flip a byte of every chunk it
sends: what the acceptance tests use to play a lying peer. Nothing else reads it.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from models.catalog.chunk_store import ChunkStore
from models.gguf.manifest import PREFIX
from swarmd.errors import RemoteProtocolError
from swarmd.net.seam import Network, Stream, StreamClosed
from swarmd.net.streams import read_frame, write_frame
from swarmd.weights.pacing import Pacer
from swarmd.weights.protocol import (
    MAX_REQUEST_BYTES,
    ChunkReply,
    GetRequest,
    HeldReply,
    HeldRequest,
    ManifestReply,
    ManifestRequest,
    Refusal,
    Request,
    decode_request,
    encode,
)
from swarmd.weights.relay_rule import REFUSAL, may_carry_weights

CORRUPT_SWITCH = "SWARMD_TEST_CORRUPT_CHUNKS"
IDLE_TIMEOUT_S = 60.0  # no request for this long: the stream is closed (an asker opens another when it needs one)
STREAMS_PER_PEER = 4  # streams served at once to one peer (a fetcher keeps one per source)


class WeightsServer:
    def __init__(self, network: Network, name: str, store: Callable[[], ChunkStore | None], pacer: Pacer, *,
                 busy: Callable[[], bool] = lambda: False,
                 blocking: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync) -> None:
        self.network = network
        self.name = name  # the model's name in the swarm
        self.store = store  # the chunks held (None: a seeded model, nothing to serve)
        self.pacer = pacer
        self.busy = busy
        self.blocking = blocking  # disk reads, off the event loop
        self.corrupt = os.environ.get(CORRUPT_SWITCH, "") == "1"
        self.stats: Counter[str] = Counter()
        self._manifest: tuple[str, bytes] | None = None
        self._open: Counter[str] = Counter()  # peer -> streams being served

    async def handle(self, peer: str, stream: Stream) -> None:
        """One inbound stream: requests answered in order until the asker closes it."""
        if not may_carry_weights(self.network, peer):
            self.stats["refused_relayed"] += 1
            await write_frame(stream, encode(Refusal(REFUSAL)))
            return
        if self._open[peer] >= STREAMS_PER_PEER:
            self.stats["refused_streams"] += 1
            await write_frame(stream, encode(Refusal(f"more than {STREAMS_PER_PEER} weights streams at once")))
            return
        self._open[peer] += 1
        try:
            while True:
                data: bytes | None = None
                with trio.move_on_after(IDLE_TIMEOUT_S):
                    try:
                        data = await read_frame(stream, MAX_REQUEST_BYTES)
                    except StreamClosed:
                        return
                if data is None:
                    self.stats["idle_streams_closed"] += 1
                    return
                request = decode_request(data)  # RemoteProtocolError: the guard strikes the peer
                await self._answer(peer, stream, request)
        finally:
            self._open[peer] -= 1
            if not self._open[peer]:
                del self._open[peer]

    async def _answer(self, peer: str, stream: Stream, request: Request) -> None:
        store = self.store()
        if isinstance(request, ManifestRequest):
            if store is None or not self._names(request.model, store):
                await write_frame(stream, encode(Refusal(f"this daemon serves {self.name}, not {request.model[:80]}")))
                return
            self.stats["manifests_served"] += 1
            await write_frame(stream, encode(ManifestReply(self.name, self._manifest_bytes(store))))
            return
        if store is None or request.model != store.digest:
            await write_frame(stream, encode(Refusal(f"this daemon serves manifest {store.digest if store else '-'}")))
            return
        if isinstance(request, HeldRequest):
            await write_frame(stream, encode(HeldReply(store.held_bits())))
            return
        assert isinstance(request, GetRequest)
        n_chunks = len(store.manifest.chunks)
        for index in request.chunks:
            if index >= n_chunks:
                raise RemoteProtocolError(f"asked for chunk {index} of a model of {n_chunks}")
            if not store.has(index):
                self.stats["chunks_refused"] += 1
                await write_frame(stream, encode(Refusal("not held here", index)))
                continue
            data = await self.blocking(store.read, index)
            if self.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            delay = self.pacer.reserve(len(data), trio.current_time(), self.busy())
            if delay > 0:
                await trio.sleep(delay)
            await write_frame(stream, encode(ChunkReply(index, data)))
            self.stats["chunks_served"] += 1
            self.stats["bytes_served"] += len(data)

    def _names(self, asked: str, store: ChunkStore) -> bool:
        if asked == self.name:
            return True
        return asked.startswith(PREFIX) and len(asked) >= len(PREFIX) + 12 and store.digest.startswith(asked[len(PREFIX):])

    def _manifest_bytes(self, store: ChunkStore) -> bytes:
        if self._manifest is None or self._manifest[0] != store.digest:
            self._manifest = (store.digest, store.manifest.encode())
        return self._manifest[1]

