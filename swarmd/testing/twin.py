"""Whole daemons in one process: `Node`s on the in-memory network, on trio's virtual clock.

Each daemon is the real thing — membership, election, the planner, the head, its stage, its experts, the actor
transport — built by `Node` with three twins in place of what would leave the event loop: the in-memory
network (`MemoryHub`), the compute thread's twin (every model step runs inline, so virtual time stands still
during it) and inline blocking work (the planner, tokenizer loads). The HTTP API is left out.

    hub = await nursery.start(MemoryHub().run)
    twin = SwarmTwin(hub, root, model_path)
    a = await twin.start(nursery, 0)                  # founds the swarm
    b = await twin.start(nursery, 1, via=a)           # joins through a
    outcome = await twin.generate(a, [1, 2, 3], max_tokens=8, seed=5)
    twin.crash(b); await twin.restart(nursery, b)     # kill -9, then the same identity again

Stages and expert shards come from a `ModelPool` that hands a loaded one back out when a daemon is done with it,
so a run of many swarms compiles each block range's graphs once. They keep no graphs on disk (the graph
cache is off for them): a seed replays the same whatever earlier runs left there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from swarmd.config import LOCAL_TEST, DaemonConfig, Timings
from swarmd.daemon.node import Node
from swarmd.inference.head.service import HeadError, HeadRequest
from swarmd.inference.head.session import Failed, Finished, TokenOut
from swarmd.net.identity import IDENTITY_FILE
from swarmd.testing.inline_compute import InlineCompute
from swarmd.testing.memory_network import MemoryHub

# Timings for simulated swarms: the local-test preset, with waits short enough that a request the swarm cannot
# serve ends in a few (virtual) seconds instead of minutes of heartbeats.
SIM_TIMINGS = replace(LOCAL_TEST, heartbeat_interval=0.5, suspect_after=1.5, ready_timeout=10.0,
                      first_token_timeout=10.0, token_timeout=6.0, send_timeout=6.0, cancel_timeout=6.0,
                      drain_timeout=5.0, dead_retention=30.0, request_idle_timeout=6.0)
BENCH = {"flops": 5e10, "mem_bandwidth": 1e10, "matmul_n": 256, "seconds": 0.1}  # what every simulated device measures


async def run_inline(fn: Callable[..., Any], *args: Any) -> Any:
    """Blocking work (the planner, a tokenizer load) run at once: virtual time does not move meanwhile."""
    value = fn(*args)
    await trio.lowlevel.checkpoint()
    return value


class ModelPool:
    """Loaded stages and expert shards, keyed by what they hold, lent to daemons and taken back."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[Any]] = {}
        self._lent: dict[int, tuple[str, tuple[Any, ...], Any]] = {}  # id(model) -> (daemon, key, model)

    def stage_loader(self, daemon: str) -> Callable[..., Any]:
        from models.tinygrad_ext import graph_cache
        from swarmd.daemon.assignment import load_stage

        def load(model: Any, start: int, end: int, device: str, max_context: int, max_requests: int, *,
                 reuse: Any = None) -> Any:
            self._return_held(daemon, "stage")
            key = ("stage", model.digest, start, end, device, max_context, max_requests)
            with graph_cache.switched_off():
                stage = self._take(key) or load_stage(model, start, end, device, max_context, max_requests)
            self._lent[id(stage)] = (daemon, key, stage)
            return stage

        return load

    def expert_loader(self, daemon: str) -> Callable[..., Any]:
        from models.tinygrad_ext import graph_cache
        from swarmd.daemon.assignment import load_experts

        def load(model: Any, experts: dict[int, tuple[int, ...]], device: str) -> Any:
            self._return_held(daemon, "experts")
            key = ("experts", model.digest, tuple(sorted(experts.items())), device)
            with graph_cache.switched_off():
                shard = self._take(key) or load_experts(model, experts, device)
            self._lent[id(shard)] = (daemon, key, shard)
            return shard

        return load

    def give_back(self, daemon: str) -> None:
        """The daemon is gone: every model it held may be lent again (its requests forgotten)."""
        self._return_held(daemon, "stage")
        self._return_held(daemon, "experts")

    def _take(self, key: tuple[Any, ...]) -> Any:
        free = self._free.get(key)
        return free.pop() if free else None

    def _return_held(self, daemon: str, kind: str) -> None:
        for ident, (holder, key, model) in list(self._lent.items()):
            if holder == daemon and key[0] == kind:
                del self._lent[ident]
                _forget_requests(model)
                self._free.setdefault(key, []).append(model)


def _forget_requests(model: Any) -> None:
    slots = getattr(model, "slots", None)
    if slots is not None:
        for request_id in slots.request_ids():
            slots.free(request_id)


@dataclass
class TwinDaemon:
    index: int
    home: Path
    config: DaemonConfig
    node: Node | None = None
    scope: trio.CancelScope | None = None
    clients: trio.Nursery | None = None  # where requests to this daemon run (ended with it, as HTTP handlers)
    stopped: trio.Event = field(default_factory=trio.Event)
    errors: list[BaseException] = field(default_factory=list)  # what escaped the daemon: a crash of ours

    @property
    def name(self) -> str:
        return f"d{self.index}"

    @property
    def peer_id(self) -> str:
        assert self.node is not None
        return self.node.peer_id

    @property
    def alive(self) -> bool:
        return self.scope is not None and not self.stopped.is_set()

    @property
    def pipeline(self) -> Any:
        assert self.node is not None
        return self.node.extension_results.get("run_pipeline")


@dataclass(frozen=True)
class Outcome:
    tokens: tuple[int, ...]
    error: str = ""  # "" when the request finished; else its error code and message


class SwarmTwin:
    def __init__(self, hub: MemoryHub, root: Path, model: str, *, timings: Timings = SIM_TIMINGS,
                 pool: ModelPool | None = None, **settings: Any) -> None:
        self.hub = hub
        self.root = Path(root)
        self.model = model
        self.timings = timings
        self.pool = pool or ModelPool()
        self.settings = {"max_context": 128, "max_requests": 4, "memory_limit": 2 << 30, "uplink_mbps": 1000.0,
                         "device": "CPU", "warmup": False, **settings}
        self.daemons: dict[int, TwinDaemon] = {}

    # --- daemons ----------------------------------------------------------------------------------------------
    async def start(self, nursery: trio.Nursery, index: int, *, via: TwinDaemon | None = None,
                    bench: dict[str, float] | None = None, **settings: Any) -> TwinDaemon:
        """Start daemon `index` (founding the swarm, or joining through `via`); returns once it is up. `bench`
        overrides what its device measures (`BENCH`: a slower device, say)."""
        home = self.root / f"d{index}"
        _write_identity(home, index)
        (home / "device-bench.json").write_text(json.dumps({**_bench(), **(bench or {})}))
        bootstrap = () if via is None else (f"/memory/{via.peer_id}/p2p/{via.peer_id}",)
        config = DaemonConfig(home=home, model=self.model, timings=self.timings, bootstrap=bootstrap,
                              **{**self.settings, **settings})
        daemon = TwinDaemon(index, home, config)
        self.daemons[index] = daemon
        await nursery.start(self._run, daemon)
        return daemon

    async def _run(self, daemon: TwinDaemon, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from swarmd.daemon.serving import run_pipeline

        name = daemon.name

        def network(key_pair: Any, cfg: DaemonConfig, access: Any) -> Any:
            from swarmd.net.identity import peer_id_of

            return self.hub.endpoint(peer_id_of(key_pair), allow=access.allow)

        node = Node(daemon.config, network=network, compute=InlineCompute(), blocking=run_inline,
                    loader=self.pool.stage_loader(name), expert_loader=self.pool.expert_loader(name),
                    serve_api=False, process_bytes=lambda: 0)  # the process is every daemon's
        node.add_extension(run_pipeline)
        daemon.node, daemon.scope, daemon.stopped = node, trio.CancelScope(), trio.Event()
        try:
            with daemon.scope:
                async with trio.open_nursery() as clients:
                    daemon.clients = clients
                    await node.run(task_status=task_status)
                    clients.cancel_scope.cancel()
        except Exception as e:  # a daemon must never end on its own: the simulation reports it
            daemon.errors.append(e)
            raise
        finally:
            daemon.stopped.set()
            self.pool.give_back(name)

    def crash(self, daemon: TwinDaemon) -> None:
        """kill -9: the process is gone at once, and its connections with it."""
        if daemon.alive and daemon.node is not None:
            self.hub.crash(daemon.node.peer_id)
            assert daemon.scope is not None
            daemon.scope.cancel()

    async def restart(self, nursery: trio.Nursery, daemon: TwinDaemon) -> TwinDaemon:
        """Start a crashed daemon again: same home, same identity, a new incarnation."""
        await daemon.stopped.wait()
        alive = [d for d in self.daemons.values() if d.alive and d is not daemon]
        via = alive[0] if alive else None
        bootstrap = () if via is None else (f"/memory/{via.peer_id}/p2p/{via.peer_id}",)
        fresh = TwinDaemon(daemon.index, daemon.home, replace(daemon.config, bootstrap=bootstrap))
        self.daemons[daemon.index] = fresh
        await nursery.start(self._run, fresh)
        return fresh

    def alive(self) -> list[TwinDaemon]:
        return [d for d in self.daemons.values() if d.alive]

    def memory_for_stages(self, stages: int) -> int:
        """A memory limit under which the model needs about `stages` daemons, so that the planner splits it
        (a small model on a fast device is otherwise best served whole by one)."""
        import math

        from planner import PlanOptions
        from planner.memory import stage_bytes
        from swarmd.daemon.served_model import served_model

        layout = served_model(self.model).layout
        opts = PlanOptions(context_length=self.settings["max_context"], concurrency=self.settings["max_requests"])
        n = layout.n_blocks
        largest = max(stage_bytes(layout, i, i + 1, opts) for i in range(n))
        experts = sum(b.moe.n_experts * b.moe.bytes_per_expert for b in layout.blocks if b.moe is not None)
        share = math.ceil((stage_bytes(layout, 0, n, opts) + experts) / max(1, stages))
        return opts.runtime_overhead_bytes + share + largest

    async def wait_ready(self, of: TwinDaemon | None = None, within: float = 30.0) -> None:
        """Until the chain `of` (the first daemon by default) sees is ready: every stage loaded."""
        d = of or self.daemons[min(self.daemons)]
        with trio.fail_after(within):
            while not (d.pipeline is not None and d.pipeline.chain().ready):  # noqa: ASYNC110 - a status snapshot
                await trio.sleep(0.25)

    async def leave(self, daemon: TwinDaemon) -> None:
        """`swarmd leave` (or SIGTERM): the daemon drains, tells the swarm, and stops."""
        assert daemon.node is not None and daemon.clients is not None
        daemon.clients.start_soon(daemon.node.leave)
        await daemon.stopped.wait()

    # --- requests ---------------------------------------------------------------------------------------------
    async def generate(self, head: TwinDaemon, prompt_ids: list[int], *, max_tokens: int, seed: int = 0,
                       temperature: float = 0.0, on_token: Callable[[int], None] | None = None) -> Outcome:
        """A request through `head`, as `/api/v0/generate` makes it: its tokens, or its error. It runs on the
        head daemon, as an HTTP handler would: if the head dies, so does the request. `on_token(n)` is told
        each token's count as it arrives."""
        tokens: list[int] = []
        result: list[Outcome] = []
        finished = trio.Event()
        request = HeadRequest(tuple(prompt_ids), max_tokens, temperature=temperature, seed=seed)

        async def client() -> None:
            try:
                result.append(await self._request(head, request, tokens, on_token))
            finally:
                finished.set()

        if head.clients is None or not head.alive:
            return Outcome((), "head_down: the daemon is not running")
        head.clients.start_soon(client)
        await finished.wait()
        return result[0] if result else Outcome(tuple(tokens), "head_died: the daemon heading it stopped")

    @staticmethod
    async def _request(head: TwinDaemon, request: HeadRequest, tokens: list[int],
                       on_token: Callable[[int], None] | None) -> Outcome:
        try:
            async with head.pipeline.head.open(request) as handle:
                async for event in handle:
                    if isinstance(event, TokenOut):
                        tokens.append(event.token_id)
                        if on_token is not None:
                            on_token(len(tokens))
                    elif isinstance(event, Failed):
                        return Outcome(tuple(tokens), f"{event.code}: {event.message}")
                    elif isinstance(event, Finished):
                        break
        except HeadError as e:
            return Outcome(tuple(tokens), f"{e.code}: {e.message}")
        return Outcome(tuple(tokens))


def _write_identity(home: Path, index: int) -> None:
    """A fixed identity per daemon index, so that a seed draws the same peer ids every time."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    home.mkdir(parents=True, exist_ok=True)
    path = home / IDENTITY_FILE
    if not path.exists():
        path.write_bytes(create_new_key_pair(bytes([index + 1]) * 32).private_key.serialize())
        path.chmod(0o600)


def _bench() -> dict[str, Any]:
    import tinygrad

    from swarmd.daemon.descriptor import cpu_name

    return {"device": "CPU", "device_name": cpu_name(), "tinygrad": getattr(tinygrad, "__version__", "?"), **BENCH}
