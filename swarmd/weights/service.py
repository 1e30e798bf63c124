"""A daemon's weights in the swarm: it serves the chunks it holds, and fetches those its assignment lacks.

`WeightsService(network, model, members=...)` is started by the node before its assignment; the assignment
calls `await weights.ensure(layers, experts)` before it loads anything, which returns at once when every chunk
is held (a whole file, or a partial model that has them) and otherwise fetches the missing ones from members
(`swarmd.weights.fetcher`), the assignment showing "loading" meanwhile. What is fetched is served onward at
once. `holds()` goes into the descriptor (the planner prefers holders), `fetch_status()` into heartbeats
(bytes, rate, ETA in every member's `swarmd status`), `status()` and `counters()` into status and /metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import trio

from models.catalog.chunk_store import ChunkStore, PartialModel
from models.errors import ModelError
from planner import ModelLayout
from planner.holdings import format_holdings
from swarmd.net.seam import Network
from swarmd.weights.fetcher import Fetcher
from swarmd.weights.pacing import Pacer
from swarmd.weights.parts import ModelParts
from swarmd.weights.progress import FetchProgress
from swarmd.weights.protocol import PROTOCOL
from swarmd.weights.server import WeightsServer

log = logging.getLogger("swarmd.weights")


class HeldModel(Protocol):
    """What the service needs of the model a daemon serves (`swarmd.daemon.served_model.ServedModel`)."""

    @property
    def name(self) -> str: ...
    @property
    def store(self) -> ChunkStore | None: ...  # a whole file, a partial model, or None (seeded weights)
    @property
    def path(self) -> Path | None: ...
    @property
    def layout(self) -> ModelLayout: ...
    @property
    def seeded(self) -> Any: ...


class WeightsService:
    def __init__(self, network: Network, model: HeldModel, *, members: Callable[[], Sequence[str]],
                 serve_bytes_per_s: float = 25e6, busy_bytes_per_s: float = 5e6,
                 busy: Callable[[], bool] = lambda: False, refresh_s: float = 2.0,
                 blocking: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync) -> None:
        self.network = network
        self.model = model
        self.store = model.store
        self.members = members  # live members but this daemon: who may hold chunks
        self.progress = FetchProgress()
        if serve_bytes_per_s > 0:  # busy never serves faster than idle
            busy_bytes_per_s = min(busy_bytes_per_s, serve_bytes_per_s) if busy_bytes_per_s > 0 else serve_bytes_per_s
        self.server = WeightsServer(network, model.name, lambda: self.store,
                                    Pacer(serve_bytes_per_s, busy_bytes_per_s), busy=busy,
                                    blocking=blocking)
        self.fetcher: Fetcher | None = None
        if isinstance(self.store, PartialModel):
            self.fetcher = Fetcher(network, self.store, members, progress=self.progress, refresh_s=refresh_s,
                                   blocking=blocking)
        self.parts: ModelParts | None = None
        if self.store is not None and model.path is not None:
            header = self.store.manifest.gguf_header(model.path)
            self.parts = ModelParts(self.store.manifest, header, model.layout.n_blocks, model.layout.is_moe)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.network.serve(PROTOCOL, self.server.handle, bulk=True)  # chunks ride the TLS data plane
        task_status.started(self)

    async def ensure(self, layers: tuple[int, int] | None, experts: Mapping[int, Sequence[int]]) -> None:
        """Return once every chunk of blocks `layers` (with what their stage carries) and of `experts` is held
        here, fetching what is missing; ModelError if it cannot be (a whole file lacks nothing)."""
        if self.store is None or self.parts is None:
            return  # seeded weights are drawn, not held
        wanted = self.parts.assignment(layers, experts)
        missing = self.store.missing(wanted)
        chunks = self.store.manifest.chunks
        log.info("weights for %s: %.1f MiB, %.1f MiB of it to fetch", describe(layers, experts),
                 sum(chunks[i].length for i in wanted) / 2**20, sum(chunks[i].length for i in missing) / 2**20)
        if not missing:
            return
        if self.fetcher is None:
            raise ModelError(f"{self.model.name}: {len(missing)} chunks are missing from {self.store.path}")
        await self.fetcher.fetch(missing)

    # --- what others see ------------------------------------------------------------------------------------
    def holds(self) -> tuple[str, ...]:
        if self.model.seeded is not None:
            return ("*",)
        if self.store is None or self.parts is None:
            return ()
        return self.parts.holdings(self.store.held())

    def fetch_status(self) -> tuple[int, int, float]:
        """(bytes fetched, bytes to fetch, bytes per second) of the fetch under way; zeros when none is."""
        p = self.progress
        if not p.active:
            return (0, 0, 0.0)
        return (p.done, p.total, p.rate(trio.current_time()))

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        store = self.store
        out: dict[str, Any] = {"protocol": PROTOCOL, "held_bytes": store.held_bytes() if store else 0,
                               "model_bytes": store.manifest.tensor_bytes if store else 0,
                               "partial": isinstance(store, PartialModel), "holds": list(self.holds()),
                               "fetch": self.progress.to_json(now),
                               "served": {k: v for k, v in self.server.stats.items()}}
        if self.fetcher is not None:
            out["fetched_from"] = {p: n for p, n in self.fetcher.bytes_from.items()}
        return out

    def counters(self) -> dict[str, float]:
        """Counters for /metrics (`weights_*`)."""
        out = {f"weights_{k}": float(v) for k, v in self.server.stats.items()}
        if self.fetcher is not None:
            out.update({f"weights_{k}": float(v) for k, v in self.fetcher.stats.items()})
        return out


def describe(layers: tuple[int, int] | None, experts: Mapping[int, Sequence[int]]) -> str:
    """'blocks 5-9', 'experts x3:0-1 x4:2-3' (planner.holdings' notation), or both."""
    parts = [f"blocks {layers[0]}-{layers[1] - 1}"] if layers else []
    if experts:
        parts.append("experts " + " ".join(format_holdings(experts=experts)))
    return " and ".join(parts) or "nothing"


def weight_holders(swarm: Any) -> list[str]:
    """Members that may serve chunks: not dead, and holding some weights by their descriptor."""
    if swarm is None:
        return []
    from swarmd.swarm.membership import State

    return [p for p, m in sorted(swarm.membership.members.items())
            if m.state != State.DEAD and m.descriptor.holds]


class Activity:
    """Whether this daemon is busy with requests: some in flight, or its compute thread worked lately (a
    stage's step for a request headed elsewhere). `sample()` returns numbers that change while it works."""

    def __init__(self, sample: Callable[[], tuple[float, float]], window_s: float = 1.0) -> None:
        self.sample = sample
        self.window_s = window_s
        self._last: tuple[float, float] | None = None
        self._changed_at = float("-inf")

    def __call__(self) -> bool:
        in_flight, busy_seconds = self.sample()
        now = trio.current_time()
        if self._last is None or busy_seconds != self._last[1]:
            self._changed_at = now if self._last is not None else self._changed_at
        self._last = (in_flight, busy_seconds)
        return in_flight > 0 or now - self._changed_at < self.window_s
