"""What the plan gives this daemon, loaded: a `models.stage.StageModel` for its block range, and a
`models.expert_shard.ExpertShard` for the routed experts of MoE blocks the plan puts here.

The node calls `Assignment.apply(announcement)` whenever it accepts a plan; `run()` loads the
stage on the node's compute thread (a load never blocks heartbeats), releasing the old one first so memory
follows the plan, and reports idle -> loading -> ready (or failed, with the reason) through
`status()`, which goes into every heartbeat and into `swarmd status`; the states and their one table of
transitions are in `swarmd.daemon.assignment_machine`. Other parts of the daemon
get the loaded stage from `stage` once `await wait_ready()` returns, and the experts from `experts`.
A stage of a MoE model loads no routed expert: they are served by the expert actors wherever the
plan put them (this daemon's included).

A stage's jitted graphs come from the graph cache when it holds them (`models.cached_graphs`): a stage whose
graphs are all there loads and runs each once before it reports ready, so its first request (a replay after
a re-plan included) finds it warm; otherwise, once ready, the daemon captures the graphs a first request needs
in the background (on the compute thread, between requests) and stores them, so that the next load is warm.

A spare (`Plan.standbys`) loads its copy of a stage's blocks the same way, warms it (the jitted graphs a
takeover needs first are captured) and reports "standby" with those layers; when a repaired plan gives it
that very stage, it is ready at once: nothing loads, nothing compiles.

When the new block range overlaps the one loaded (a survivor whose range grows after a stage was lost with
no spare, or shrinks when a node comes back), the old stage is handed to the loader instead of released:
the new stage takes over its realised blocks (and the embedding / head when both have it) and reads only
the blocks it lacks; the old stage is dropped on the compute thread once the new one is built. Its KV
caches are not kept (requests move by replay). `swarmd join --full-reload` turns this off (to measure it).

A stage holds as many requests at once (KV cache slots) as its memory allows: the daemon's memory (its
`--memory-limit`, else the device's; what is free now plus what the stage it replaces held) less the new
stage's weights and the runtime, divided by one request's KV cache at the full context
(`planner.memory.kv_slots`); `--max-requests` is the most. The runtime is the planner's overhead; on a CPU,
whose memory is the process's own, what the process holds besides its stage when it loads, plus that overhead
(compiled kernels and the graphs of each batch size come later). The loaded stage's slots, and how many are taken,
go into every heartbeat (`AssignmentStatus.kv`, from the stage actor) so that heads know when one is free.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import trio

from planner.memory import kv_slots
from planner.options import PlanOptions
from swarmd.daemon.assignment_machine import AssignmentEvent, held, next_state
from swarmd.daemon.served_model import ServedModel
from swarmd.inference.compute import Compute
from swarmd.wire.gossip import AssignmentState, AssignmentStatus, PlanAnnouncement

log = logging.getLogger(__name__)

# (model, start, end, device, max_context, max_requests, reuse=an overlapping loaded stage or None) -> a stage
StageLoader = Callable[..., Any]
# (model, {block: experts}, device) -> a loaded ExpertShard
ExpertLoader = Callable[[ServedModel, dict[int, tuple[int, ...]], str], Any]
# (layers, {block: experts}) -> returns once their weights are on this machine (`swarmd.weights` fetches them)
Prepare = Callable[[tuple[int, int] | None, dict[int, tuple[int, ...]]], Awaitable[None]]


def load_stage(model: ServedModel, start: int, end: int, device: str, max_context: int, max_requests: int, *,
               reuse: Any = None):
    """Blocks [start, end) of the model's GGUF (or drawn from its seed), as a StageModel on `device` (blocking);
    the blocks a loaded StageModel `reuse` holds (and its embedding / head) are taken over, not read again."""
    from models.config import config_from_header
    from models.errors import ModelError
    from models.gguf.header import read_header
    from models.stage import StageModel, serving_numerics

    if model.seeded is not None:
        config = model.seeded.config(max_context)
        if model.seeded.mla:  # full-width blocks: say how many fit before drawing them
            from swarmd.daemon.descriptor import device_memory

            model.seeded.check_fits(start, end, device_memory(device)[1], config.max_context, max_requests)
        return StageModel.random(config, model.seeded.seed, start, end, max_context=config.max_context,
                                 max_requests=max_requests, device=device, reuse=reuse,
                                 local_experts=not model.layout.is_moe)
    if model.path is None:
        raise ModelError(f"no weights for {model.name} on this machine (it is known only to plan with)")
    return StageModel.from_gguf(model.path, start, end, max_context=max_context, max_requests=max_requests,
                                device=device, local_experts=not model.layout.is_moe, reuse=reuse,
                                numerics=serving_numerics(config_from_header(read_header(model.path))))


def kv_value_scale(model: ServedModel) -> float:
    """The stage's KV bytes per KV byte the layout counts (16-bit values): `load_stage` keeps a dense GGUF
    model's cache in float16 (ggml numerics), the others' in float32."""
    return 1.0 if model.seeded is None and model.path is not None and not model.layout.is_moe else 2.0


KV_PAD_ROWS = 128  # rows a stage's KV pool holds past the context (a prefill chunk's padding, attention tiles)


def load_experts(model: ServedModel, experts: dict[int, tuple[int, ...]], device: str):
    """The routed experts `experts` of the model's GGUF, as an ExpertShard on `device` (blocking)."""
    from models.config import config_from_header
    from models.errors import ModelError
    from models.expert_shard import ExpertShard
    from models.gguf.header import read_header
    from models.stage import serving_numerics

    if model.seeded is not None and model.seeded.mla:
        from models.catalog.seeded_quantized import expert_weights

        config = model.seeded.config()
        return ExpertShard(config, expert_weights(config, model.seeded.seed, experts, device), experts, device)
    if model.path is None:
        raise ModelError(f"no weights for {model.name} on this machine (it is known only to plan with)")
    numerics = serving_numerics(config_from_header(read_header(model.path)))
    return ExpertShard.from_gguf(model.path, experts, device=device, numerics=numerics)


class Assignment:
    def __init__(self, peer_id: str, model: ServedModel, device: str, compute: Compute, *,
                 max_context: int = 2048, max_requests: int = 4, loader: StageLoader = load_stage,
                 expert_loader: ExpertLoader = load_experts, warmup: bool = False, reuse_blocks: bool = True,
                 prepare: Prepare | None = None,
                 memory: Callable[[], tuple[int, int]] | None = None,
                 process_bytes: Callable[[], int] | None = None,
                 options: PlanOptions | None = None) -> None:
        self.peer_id = peer_id
        self.prepare = prepare  # fetches the weights an assignment lacks before it loads (cancelled if the plan moves)
        self._preparing: trio.CancelScope | None = None
        self.reuse_blocks = reuse_blocks  # a new range takes the loaded stage's blocks over (off: reload all)
        self.warmup = warmup  # capture every graph before a stage is ready (`swarmd join --warmup`)
        self.compute = compute
        self.model = model
        self.device = device
        self.max_context = max_context
        self.max_requests = max_requests  # the most KV slots a stage gets (its memory may allow fewer)
        self.memory = memory  # (total, free) bytes of the daemon's memory; None: every stage gets max_requests
        self.process_bytes = process_bytes or process_rss  # what the process holds now (on a CPU its memory is the device's)
        self.options = options or PlanOptions(context_length=max_context)
        self.slots = 0  # KV slots of the loaded stage
        self.kv_slots: Callable[[], tuple[int, int, int] | None] = lambda: None  # the stage actor's, for heartbeats
        self.loader = loader
        self.expert_loader = expert_loader
        self.stage: Any = None  # the loaded StageModel, or None
        self.loaded_layers: tuple[int, int] | None = None
        self.experts: Any = None  # the loaded ExpertShard, or None
        self.loaded_experts: dict[int, tuple[int, ...]] = {}
        self._status = AssignmentStatus()
        # (epoch, the stage's layers, experts, the layers of a standby copy)
        self._wanted: tuple[int, tuple[int, int] | None, dict[int, tuple[int, ...]], tuple[int, int] | None] = (
            0, None, {}, None)
        self._wake = trio.Event()
        self._ready = trio.Event()
        self.load_started: float | None = None
        self._background: trio.Nursery | None = None  # set by run(): the graph cache's fill runs there
        self._held = 0  # bytes the loaded stage takes (weights and KV pool), for the next one's budget

    def status(self) -> AssignmentStatus:
        if self._status.state == AssignmentState.READY and self.stage is not None:
            kv = self.kv_slots()
            if kv is not None:
                return replace(self._status, kv=kv)
        return self._status

    def slots_for(self, a: int, b: int, held: int) -> int:
        """KV slots a stage of blocks [a, b) gets in this daemon's memory (`held`: bytes of the stage it
        replaces, which it lets go); `max_requests` when the memory is not known."""
        if self.memory is None:
            return self.max_requests
        total, free = self.memory()
        blocks = self.model.layout.blocks
        experts = sum(len(es) * moe.bytes_per_expert for blk, es in self.loaded_experts.items()
                      if (moe := blocks[blk].moe) is not None)
        overhead = self.options.runtime_overhead_bytes
        if not on_gpu(self.device):  # the process's memory is the device's: count what it holds already
            overhead += max(0, self.process_bytes() - held - experts)
        opts = replace(self.options, context_length=self.max_context + KV_PAD_ROWS, runtime_overhead_bytes=overhead)
        return kv_slots(self.model.layout, a, b, opts, min(total, free + held), most=self.max_requests,
                        kv_scale=kv_value_scale(self.model), extra_bytes=experts)

    def apply(self, ann: PlanAnnouncement) -> None:
        """Take the part of an accepted plan that names this daemon (synchronous; loading happens in run)."""
        plan = ann.plan
        mine = [s.layers for s in plan.stages if s.peer_id == self.peer_id]
        if len(mine) > 1:
            log.warning("plan epoch %d gives this node %d stages; only the first is loaded", plan.epoch, len(mine))
        layers = mine[0] if mine else None
        copy = plan.standbys.get(self.peer_id) if layers is None else None
        experts = {b: tuple(es) for b, es in plan.experts_on(self.peer_id).items()}
        if self._preparing is not None and self._wanted[1:] != (layers, experts, copy):
            self._preparing.cancel()  # a fetch for an assignment the plan no longer gives
        self._wanted = (plan.epoch, layers, experts, copy)
        if ((layers or copy) == self.loaded_layers and experts == self.loaded_experts
                and self._status.state in (AssignmentState.READY, AssignmentState.IDLE, AssignmentState.STANDBY)):
            # Already loaded (a spare promoted to the stage it holds a copy of, or a survivor keeping its
            # blocks): say so now, so that the next heartbeat shows the chain ready.
            self._fire(held(layers, copy, experts), replace(self._status, epoch=plan.epoch, experts=experts,
                                                            progress=1.0 if layers or copy else 0.0))
        self._wake.set()

    async def wait_ready(self) -> Any:
        """The loaded stage, once the current assignment is ready."""
        while self._status.state != AssignmentState.READY or self.stage is None:
            await self._ready.wait()
            if self._status.state != AssignmentState.READY:
                self._ready = trio.Event()
        return self.stage

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._background = nursery
            task_status.started(self)
            await self._follow_the_plan()

    async def _follow_the_plan(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            epoch, layers, experts, copy = self._wanted
            if experts != self.loaded_experts and not await self._load_experts(epoch, layers, experts):
                continue
            target = layers or copy
            if target == self.loaded_layers and not self._stage_experts_stale():
                self._fire(held(layers, copy, experts),
                           AssignmentStatus(epoch, target, experts, progress=1.0 if target or experts else 0.0))
                continue
            previous = self._hand_over(target)
            if target is None:
                self._fire(held(None, None, experts), AssignmentStatus(epoch, None, experts))
                log.info("plan epoch %d: no blocks for this node; released the stage", epoch)
                continue
            await self._load(epoch, target, experts, warm=layers is None, previous=previous)

    async def _load_experts(self, epoch: int, layers: tuple[int, int] | None,
                            experts: dict[int, tuple[int, ...]]) -> bool:
        """Load the shard of experts the plan gives this node (none: release it); False if it failed."""
        self.experts, self.loaded_experts = None, {}
        if not experts:
            return True
        count = sum(len(es) for es in experts.values())
        self._fire(AssignmentEvent.LOAD_STARTED, AssignmentStatus(epoch, layers, experts))
        if not await self._prepared(None, experts, epoch, layers):
            return False
        try:
            shard = await self.compute.run(self.expert_loader, self.model, experts, self.device)
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            self._fire(AssignmentEvent.LOAD_FAILED, AssignmentStatus(epoch, layers, experts, error=f"experts: {reason}"))
            log.warning("loading %d experts failed: %s", count, reason)
            return False
        if self._wanted[2] != experts:
            return False  # the plan moved on; the wake event is already set by apply()
        self.experts, self.loaded_experts = shard, experts
        log.info("loaded %d experts of %d MoE blocks", count, len(experts))
        return True

    async def _load(self, epoch: int, layers: tuple[int, int], experts: dict[int, tuple[int, ...]], *,
                    warm: bool = False, previous: list[Any] | None = None) -> None:
        """Load blocks `layers`; `warm` (a standby copy) also captures every jitted graph before it is ready.
        `previous`: the old stage (in a list the compute thread empties), whose blocks the new one takes over."""
        a, b = layers
        self._fire(AssignmentEvent.LOAD_STARTED, AssignmentStatus(epoch, layers, experts))
        self.load_started = trio.current_time()
        what = "a standby copy of blocks" if warm else "blocks"
        log.info("loading %s %d-%d of %s (plan epoch %d)", what, a, b - 1, self.model.name, epoch)
        if not await self._prepared(layers, {}, epoch, layers):
            return
        try:
            # a daemon told to stop does not wait for a load to finish: run() returns when cancelled
            stage = await self.compute.run(self._build, a, b, previous or [])
            warmed = True
            if self.warmup and hasattr(stage, "warmup"):
                await self.compute.run(stage.warmup)
            elif warm and hasattr(stage, "warmup"):
                # What taking over a request needs at once: the replay's prefill and one request's decode
                # (larger batches and prompt scoring are captured when first used; on a small CPU each
                # graph costs many seconds).
                await self.compute.run(functools.partial(stage.warmup, most_requests=1, prompt_scores=False))
            else:  # the same, when the graph cache holds those graphs: a replay each, no capture
                from models.cached_graphs import warm_from_cache

                warmed = await self.compute.run(warm_from_cache, stage)
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            self._fire(AssignmentEvent.LOAD_FAILED, AssignmentStatus(epoch, layers, experts, error=reason))
            log.warning("loading blocks %d-%d failed: %s", a, b - 1, reason)
            return
        took = trio.current_time() - self.load_started
        epoch, wanted, experts, copy = self._wanted
        if (wanted or copy) != layers:
            log.info("blocks %d-%d loaded in %.1f s but the plan moved on; loading again", a, b - 1, took)
            return  # the wake event is already set by apply()
        self.stage, self.loaded_layers = stage, layers
        self._fire(held(wanted, copy, experts), AssignmentStatus(epoch, layers, experts, progress=1.0))
        if self._status.state == AssignmentState.STANDBY:
            log.info("standby: a copy of blocks %d-%d loaded and warmed in %.1f s", a, b - 1, took)
        else:
            kept = sorted(getattr(getattr(stage, "reused", None), "blocks", ()))
            log.info("ready: blocks %d-%d loaded in %.1f s%s%s", a, b - 1, took,
                     f" (blocks {kept[0]}-{kept[-1]} kept from the previous stage)" if kept else "",
                     "; graphs from the graph cache" if warmed and not self.warmup else "")
        if not warmed and self._background is not None:
            self._background.start_soon(self._fill_graph_cache, stage)

    async def _fill_graph_cache(self, stage: Any) -> None:
        """Capture and store the graphs a first request of `stage` needs that the graph cache lacks, unless the
        stage was replaced or got requests first (their steps capture, and store, what they use)."""
        from models.cached_graphs import fill_cache

        def fill() -> bool:
            return self.stage is stage and fill_cache(stage)

        started = trio.current_time()
        try:
            if await self.compute.run(fill):
                log.info("graph cache filled for this stage in %.1f s", trio.current_time() - started)
        except Exception as e:  # a failed capture here fails the first request too, which reports it
            log.warning("filling the graph cache failed: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)

    async def _prepared(self, layers: tuple[int, int] | None, experts: dict[int, tuple[int, ...]], epoch: int,
                        shown: tuple[int, int] | None) -> bool:
        """Have `prepare` fetch what blocks `layers` and `experts` lack; False if the plan moved on meanwhile (its
        wake event is set) or the fetch failed (the status says why)."""
        if self.prepare is None:
            return True
        with trio.CancelScope() as scope:
            self._preparing = scope
            try:
                await self.prepare(layers, experts)
            except Exception as e:
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._fire(AssignmentEvent.LOAD_FAILED,
                           AssignmentStatus(epoch, shown, self._wanted[2], error=f"weights: {reason}"))
                log.warning("getting the weights of %s failed: %s", f"blocks {layers}" if layers else "experts", reason)
                return False
            finally:
                self._preparing = None
        return not scope.cancelled_caught

    def _release(self) -> None:
        self.stage, self.loaded_layers = None, None

    def _hand_over(self, target: tuple[int, int] | None) -> list[Any]:
        """Release the loaded stage; returned (in a list) when `target` overlaps its blocks, for the new
        stage to take them over; otherwise it is dropped now, before the load, so memory follows the plan."""
        old, held = self.stage, self.loaded_layers
        self._release()
        if old is None or held is None or target is None or not self.reuse_blocks:
            return []
        return [old] if max(held[0], target[0]) < min(held[1], target[1]) else []

    def _build(self, a: int, b: int, previous: list[Any]) -> Any:
        """On the compute thread: the stage for blocks [a, b), taking over what it can of the stage in
        `previous`, which it then drops here (its jitted graphs must be finalised on this thread)."""
        old = previous.pop() if previous else None
        try:
            freed = _stage_bytes(old) if old is not None else self._held
            self.slots = slots = self.slots_for(a, b, freed)
            if old is None:
                stage = self.loader(self.model, a, b, self.device, self.max_context, slots)
            else:
                stage = self.loader(self.model, a, b, self.device, self.max_context, slots, reuse=old)
            self._held = _stage_bytes(stage)
            if self._experts_in_graph(stage):
                log.info("blocks %d-%d run this node's experts of them inside their graph", a, b - 1)
            log.info("blocks %d-%d: %d KV cache slots (%s)", a, b - 1, slots,
                     "the most --max-requests allows" if slots == self.max_requests else "as many as memory allows")
            return stage
        finally:
            del old

    def _experts_in_graph(self, stage: Any) -> bool:
        """Hand `stage` this node's shard (`StageModel.use_experts`) where the model runs its experts in its graph as
        `swarmd run` does: True if the stage runs them in its graph."""
        return hasattr(stage, "use_experts") and stage.use_experts(self._graph_shard(stage))

    def _graph_shard(self, stage: Any) -> Any:
        """This node's shard, where the model runs its experts in its graph (`models.stage.run_experts_in_graph`)."""
        from models.stage import run_experts_in_graph

        return self.experts if run_experts_in_graph(stage.config) else None

    def _stage_experts_stale(self) -> bool:
        """Whether the loaded stage runs its experts otherwise than this node's shard now allows: in its graph
        from a shard this node no longer holds, or cut where the shard now holds them all (it is rebuilt)."""
        stage = self.stage
        if not hasattr(stage, "use_experts") or stage.shards_experts:
            return False
        want = stage.can_run_in_graph(self._graph_shard(stage))
        return stage.experts_in_graph != want or (want and stage.expert_shard is not self.experts)

    def _fire(self, event: AssignmentEvent, status: AssignmentStatus) -> None:
        """Report `status` in the state the transition table gives for `event` from the current one."""
        self._status = replace(status, state=next_state(self._status.state, event))
        if self._status.state == AssignmentState.READY:
            self._ready.set()
        elif self._ready.is_set():
            self._ready = trio.Event()


def process_rss() -> int:
    """Bytes this process holds in memory now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def on_gpu(device: str) -> bool:
    from models.kernels.matvec import GPU_DEVICES

    return device.split(":")[0] in GPU_DEVICES


def _stage_bytes(stage: Any) -> int:
    """Device bytes a loaded stage holds: its weights and its KV pool (0 for a stage that does not say)."""
    try:
        return int(stage.weight_bytes()) + int(stage.kv.nbytes())
    except AttributeError:
        return 0
