"""The MoE router: `moe-router-{block}` on the daemon whose stage owns a MoE block.

For each MoE block and step the stage hands it one `ExpertCall` (every row of the batch with its
selected experts and gates). The router picks one holder per selected expert (observed latency times
load, `swarmd.inference.moe.dispatch`), sends **one `ExpertBatch` per node** with just that node's rows and
experts, gathers the `ExpertResult`s (each selected expert's output) and makes each row's gate-weighted
sum in the order of its selections (`dispatch.combine`): what the stage adds to its residual stream. Frames are retried over dropped links and de-duplicated by the transport; a node
that refuses, cannot be reached or does not answer in time is avoided and its experts are asked of
another holder, while any is left.

A node that membership declares dead (`peer_state`) is never asked again, and every batch waiting on it
(to be acked, or acked and waiting for its answer) ends at once: its rows go to a replica of its
experts if the plan has one. A batch whose experts have a replica does not even wait for that verdict:
it goes to the replica as soon as the transport's stream to the node breaks (`link_lost`). An expert
left with no live holder waits, up to `plan_wait`, for the leader's next plan to place it on a survivor
(which loads it; its expert actor waits for the load), then its rows are sent there; past that, or when
the leader says the swarm cannot hold the experts (`cannot_hold`), the step fails with
`ExpertsUnavailable` saying which experts and why.

For traced requests among the rows (`traced`: request id -> step) it records, on this daemon's clock,
`moe.fan_out` per call (first batch sent -> every answer in; `messages`, `nodes`, `rows`) and per node
`moe.send` (batch ready -> acked) and `moe.call` (batch ready -> its answer in): the wait for results is
`moe.call` minus `moe.send`. The expert records its side under the same flow id (`swarmd.inference.moe.expert`).
A call that this daemon's own shard answers whole never reaches the router: the stage computes it in place
(`swarmd.inference.moe.local`) and the router only counts it (`record_local`; its `moe.fan_out` has no messages).

A hot step (a stage's decode step on a lane's reader thread, `swarmd.inference.stage.actor`) calls `fan_out`
on that thread instead: the batches to every remote node leave at once on the lane, this daemon's own part is
computed meanwhile, and the answers are summed into one buffer (`swarmd.inference.moe.fan_out.FanOut`) by
whichever thread brings them. Only what goes wrong comes to the event loop: a part whose node refused, died,
lost its link or stayed silent for `result_timeout` is asked again by `call` above, with all its care.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from planner.plan import router_actor
from swarmd.inference.moe.dispatch import (
    NodePart,
    ReplicaChooser,
    combine,
    give_up_reason,
    split_by_node,
    tokens_per_expert,
    unserved,
)
from swarmd.inference.moe.fan_out import FanOut
from swarmd.inference.moe.local import LocalAnswer, LocalExperts
from swarmd.net.identity import short_id
from swarmd.observe.recent import RecentTimes
from swarmd.observe.spans import SpanRecorder, flow_id
from swarmd.tasks import spawn
from swarmd.transport.transport import DeliveryFailed, Refused
from swarmd.wire.codec import WireTensor
from swarmd.wire.messages import Error, ExpertBatch, ExpertResult

log = logging.getLogger(__name__)

RESULT_TIMEOUT = 120.0  # s a node that acked a batch has to answer it (first batches compile kernels) before
# its experts are asked elsewhere
PLAN_WAIT = 60.0  # s a step waits for a plan that places experts whose every holder died on a live node
PLAN_POLL = 0.05  # s between looks at the plan while waiting for it


class ExpertsUnavailable(Exception):
    """No holder of some selected expert answered and no plan placed it on a live node in time: the step
    fails (the request gets an error)."""


@dataclass
class _Pending:
    peer: str
    call: Any  # the part of the layer's call asked of `peer` (a models.moe.ExpertCall)
    done: trio.Event = field(default_factory=trio.Event)
    answer: np.ndarray | None = None
    error: str | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)  # cancelled when the peer dies


@dataclass
class _HotPart:
    """A batch of a hot step's fan-out, waiting for its answer."""

    fan: FanOut
    part: NodePart
    at: float  # the event loop's clock: for `result_timeout` and the replica chooser


@dataclass
class LayerStats:
    calls: int = 0
    rows: int = 0
    messages: int = 0  # ExpertBatch frames sent (one per node hit per call, plus retries elsewhere)
    nodes_hit: int = 0  # distinct nodes per call, summed
    local: int = 0  # calls this daemon's own shard answered in place: one node hit, no message
    fan_out: RecentTimes = field(default_factory=RecentTimes)
    tokens: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # expert -> rows routed


class MoERouter:
    def __init__(self, transport: Any, holders: Callable[[int], Mapping[int, tuple[str, ...]]], *,
                 wire_dtype: str | None = None, result_timeout: float = RESULT_TIMEOUT,
                 plan_wait: float = PLAN_WAIT, cannot_hold: Callable[[], str | None] = lambda: None) -> None:
        self.transport = transport
        self._holders = holders  # block -> expert -> holder peer ids (the current plan's, nearest first)
        self.wire_dtype = wire_dtype
        self.result_timeout = result_timeout
        self.plan_wait = plan_wait
        self._cannot_hold = cannot_hold  # why the swarm can no longer hold the model, when known here
        self.dead: set[str] = set()  # peers membership says are dead: never asked
        self.waits = 0  # steps that waited for a plan to re-place experts of dead nodes
        self.chooser = ReplicaChooser(trio.current_time)
        self.hot_calls = RecentTimes()  # a hot batch out -> its answer in, per remote part
        self.layers: dict[int, LayerStats] = defaultdict(LayerStats)
        self._prefix = f"{random.getrandbits(48):012x}"
        self._count = 0
        self._pending: dict[str, _Pending] = {}
        self.recorder: SpanRecorder | None = None  # spans of traced requests
        self.lane: Any = None  # the hot lane (`swarmd.transport.lane.HotLane`) hot steps send their batches on
        self._hot: dict[str, _HotPart] = {}  # batch id -> a hot fan-out's batch awaiting its answer
        self._hot_lock = threading.Lock()
        self._hot_ids = itertools.count(1)
        self._hot_done: deque[tuple[Any, float, int, int]] = deque(maxlen=4096)  # (call, s, messages, nodes)
        self._nursery: trio.Nursery | None = None

    async def call(self, call: Any, traced: Mapping[str, int] | None = None) -> np.ndarray:
        """The gate-weighted expert sum for every row of `call` (a models.moe.ExpertCall); `traced`: the
        traced requests among its rows and their steps, whose spans are recorded here and on the experts."""
        return combine(call, await self._gather(call, traced))

    async def _gather(self, call: Any, traced: Mapping[str, int] | None = None) -> list[tuple[NodePart, np.ndarray]]:
        """Every selected pair's expert output for `call`, as (the node's part, its outputs) per node that
        answered."""
        started = time.perf_counter()
        traced = dict(traced or {}) if self.recorder is not None else {}
        span_start = self.recorder.clock() if traced and self.recorder is not None else 0.0
        messages = 0
        stats = self.layers[call.layer]
        answers: list[tuple[NodePart, np.ndarray]] = []
        avoid: set[str] = set()  # failed during this call (dead peers are avoided by every call)
        todo, first = call, True
        while True:
            holders = await self._usable_holders(todo, avoid)
            parts = split_by_node(todo, holders, lambda hs: self.chooser.choose(hs, avoid | self.dead))
            results: dict[str, np.ndarray | str] = {}
            async with trio.open_nursery() as nursery:
                for part in parts:
                    nursery.start_soon(self._ask, part, results, traced)
            stats.messages += len(parts)
            messages += len(parts)
            failed = [p for p in parts if not isinstance(results[p.peer], np.ndarray)]
            for p in parts:
                if isinstance(results[p.peer], np.ndarray):
                    answers.append((p, results[p.peer]))  # type: ignore[arg-type]
            if first:
                stats.nodes_hit += len(parts)
                first = False
            if not failed:
                break
            for p in failed:
                log.warning("experts %s of block %d: %s did not answer (%s); asking another holder",
                            list(p.experts), call.layer, short_id(p.peer), results[p.peer])
                avoid.add(p.peer)
            todo = _restrict(call, {x for p in failed for x in p.experts})
        span_end = self.recorder.clock() if traced and self.recorder is not None else 0.0
        self._record_call(call, time.perf_counter() - started, traced, span_start, span_end, messages=messages,
                          nodes=len({p.peer for p, _ in answers}))
        return answers

    def record_local(self, answer: LocalAnswer, traced: Mapping[str, int]) -> None:
        """Count a call the stage had this daemon's own shard answer on the compute thread
        (`swarmd.inference.moe.local`) like the calls sent out: one node hit, no message."""
        stats = self.layers[answer.call.layer]
        stats.nodes_hit += 1
        stats.local += 1
        self._record_call(answer.call, answer.end - answer.start, traced, answer.start, answer.end, messages=0,
                          nodes=1, local=True)

    def _record_call(self, call: Any, took_s: float, traced: Mapping[str, int], span_start: float, span_end: float,
                     **span_args: Any) -> None:
        """A finished call in its layer's stats, and its `moe.fan_out` span for each traced request."""
        stats = self.layers[call.layer]
        stats.calls += 1
        stats.rows += len(call.rows)
        for expert, n in tokens_per_expert(call).items():
            stats.tokens[expert] += n
        stats.fan_out.add(took_s)
        if traced and self.recorder is not None:
            for rid, step in traced.items():
                self.recorder.add(rid, "moe.fan_out", _thread(call.layer), span_start, span_end, step=step,
                                  block=call.layer, rows=len(call.rows), **span_args)

    async def _usable_holders(self, call: Any, avoid: set[str]) -> Mapping[int, tuple[str, ...]]:
        """The plan's holders once every expert `call` selects has one neither dead nor in `avoid`: at once
        when it does, else after waiting for a plan that re-places the lost experts (ExpertsUnavailable when
        none comes within `plan_wait`, or the swarm cannot hold them)."""
        started = trio.current_time()
        holders = self._holders(call.layer)
        missing = unserved(call, holders, avoid | self.dead)
        if missing:
            self.waits += 1
            log.warning("experts %s of block %d have no live holder: waiting for a plan that re-places them",
                        missing, call.layer)
        while missing:
            reason = give_up_reason(missing, call.layer, trio.current_time() - started, self.plan_wait,
                                    self._cannot_hold())
            if reason is not None:
                raise ExpertsUnavailable(reason)
            await trio.sleep(PLAN_POLL)
            latest = self._holders(call.layer)
            if latest != holders:
                avoid &= self.dead  # a new plan: nodes that failed under the old one get another chance
                holders = latest
            missing = unserved(call, holders, avoid | self.dead)
        return holders

    def peer_state(self, peer: str, *, dead: bool) -> None:
        """Membership changed `peer`'s state: a dead peer is not asked again and every batch waiting on it
        ends now (its rows are asked of another holder); one back alive may be asked again."""
        if not dead:
            self.dead.discard(peer)
            return
        self.dead.add(peer)
        for pending in self._pending.values():
            if pending.peer == peer and not pending.done.is_set():
                pending.error = "the node is dead"
                pending.scope.cancel()
        with self._hot_lock:
            lost = [b for b, e in self._hot.items() if e.part.peer == peer]
        for batch_id in lost:
            self._hot_failed(batch_id, "the node is dead")

    def link_lost(self, peer: str) -> None:
        """The stream to `peer` broke or could not be opened (the transport still retries): a batch waiting on
        it whose experts all have another live holder is asked of them now, without waiting for membership's
        verdict (a live peer's late answer is dropped); the others wait for the retries or for that verdict."""
        for pending in self._pending.values():
            if pending.peer == peer and not pending.done.is_set() and not unserved(
                    pending.call, self._holders(pending.call.layer), self.dead | {peer}):
                pending.error = "the link to the node broke (a replica is asked)"
                pending.scope.cancel()
        with self._hot_lock:
            lost = [b for b, e in self._hot.items() if e.part.peer == peer and not unserved(
                e.part.call, self._holders(e.part.call.layer), self.dead | {peer})]
        for batch_id in lost:
            self._hot_failed(batch_id, "the link to the node broke (a replica is asked)")

    async def _ask(self, part: NodePart, results: dict[str, np.ndarray | str], traced: Mapping[str, int]) -> None:
        self._count += 1
        batch_id = f"moe-{self._prefix}-{self._count}"
        msg = ExpertBatch(batch_id, self._count, part.call.layer,
                          WireTensor.from_array(part.call.rows.astype(np.float32), self.wire_dtype),
                          WireTensor.from_array(part.call.sel.astype(np.int32)),
                          WireTensor.from_array(part.call.gates.astype(np.float32)),
                          traced=tuple(traced), traced_steps=tuple(traced.values()))
        pending = self._pending[batch_id] = _Pending(part.peer, part.call)
        self.chooser.started(part.peer)
        started = self.chooser.clock()  # the event loop's: in a simulation, virtual time decides who is asked
        clock = self.recorder.clock if traced and self.recorder is not None else None
        ready = acked = clock() if clock else 0.0
        if part.peer in self.dead:  # died since the parts were made: ask no one, fail the part
            pending.error = "the node is dead"
            pending.scope.cancel()
        try:
            with pending.scope:  # cancelled by peer_state when membership says the peer died
                await self.transport.send(part.peer, msg)
                acked = clock() if clock else 0.0
                with trio.move_on_after(self.result_timeout):
                    await pending.done.wait()
        except (DeliveryFailed, Refused) as e:
            pending.error = str(e)
        finally:
            self._pending.pop(batch_id, None)
        if clock is not None and self.recorder is not None:
            end, thread = clock(), _thread(part.call.layer)
            args = {"block": part.call.layer, "to": part.peer, "experts": ",".join(map(str, part.experts)),
                    "rows": len(part.rows)}
            for rid, step in traced.items():
                self.recorder.add(rid, "moe.send", thread, ready, max(acked, ready), step=step, **args)
                self.recorder.add(rid, "moe.call", thread, ready, end, step=step, answered=pending.answer is not None,
                                  flow=flow_id(msg.key()), **args)
        want = (int((part.call.sel >= 0).sum()), part.call.rows.shape[1])
        if pending.answer is not None and pending.answer.shape != want:
            pending.error = f"answer of shape {pending.answer.shape}, expected {want} (one row per selection)"
            pending.answer = None
        if pending.answer is not None:
            self.chooser.finished(part.peer, self.chooser.clock() - started)
            results[part.peer] = pending.answer
        else:
            self.chooser.finished(part.peer, None)
            results[part.peer] = pending.error or f"no answer within {self.result_timeout:.0f} s"

    # --- a hot step's fan-out (from a lane's reader thread) -------------------------------------------------

    def fan_out(self, call: Any, local: LocalExperts | None) -> FanOut | None:
        """On a hot step's thread, tinygrad held: one batch per remote holder of `call`'s experts sent at once,
        this daemon's part computed here meanwhile; the `FanOut` completes as the answers come in. None when a
        selected expert has no live holder (the worker's `call` waits for a plan that places it)."""
        holders = self._holders(call.layer)
        dead = frozenset(self.dead)
        if self.lane is None or unserved(call, holders, dead):
            return None
        me = self.transport.local_peer
        parts = split_by_node(call, holders, lambda hs: self.chooser.choose(hs, dead))
        fan = FanOut.of(call, len(parts))
        fan.started = time.perf_counter()
        remote = [p for p in parts if p.peer != me]
        for part in remote:
            self._send_hot(fan, part)
        for part in parts:
            if part.peer == me:
                answer = local.part(part.call) if local is not None else None
                if answer is None:  # the shard is not loaded yet, say: its expert actor waits for it
                    self._send_hot(fan, part)
                else:
                    fan.add([(part, answer)])
        fan.messages, fan.nodes = len(remote), len(parts)
        return fan

    def finished_hot(self, fan: FanOut) -> None:
        """A hot fan-out's answer was taken (any thread): counted in the layer's stats by the event loop. Parts it
        still awaited (it failed, or its step was given up) are awaited no more: a late answer is dropped."""
        with self._hot_lock:
            left = [e for e in (self._hot.pop(b, None) for b in fan.asked) if e is not None]
        for peer in (e.part.peer for e in left):
            self.chooser.dropped(peer)
        self._hot_done.append((fan.call, time.perf_counter() - fan.started, fan.messages, fan.nodes))

    def _send_hot(self, fan: FanOut, part: NodePart) -> None:
        n = next(self._hot_ids)
        batch_id = f"moe-{self._prefix}-h{n}"
        msg = ExpertBatch(batch_id, n, part.call.layer, WireTensor.from_array(part.call.rows.astype(np.float32),
                                                                              self.wire_dtype),
                          WireTensor.from_array(part.call.sel.astype(np.int32)),
                          WireTensor.from_array(part.call.gates.astype(np.float32)))
        fan.asked.append(batch_id)
        with self._hot_lock:
            self._hot[batch_id] = _HotPart(fan, part, self.lane.now())
        self.chooser.started(part.peer)
        if not self.lane.send(part.peer, msg):
            self.lane.to_loop(self._send_by_transport, part.peer, msg)

    def _send_by_transport(self, peer: str, msg: ExpertBatch) -> None:
        spawn(self._nursery, self._deliver, peer, msg)

    async def _deliver(self, peer: str, msg: ExpertBatch) -> None:
        try:
            await self.transport.send(peer, msg)
        except (DeliveryFailed, Refused) as e:
            self._hot_failed(msg.batch_id, str(e))

    def take_hot_result(self, peer: str, msg: ExpertResult, reply: Any) -> Any:
        """The lane's handler of `ExpertResult`s: a hot fan-out's answer is added where it arrives; any other
        goes to `on_result` on the event loop."""
        from swarmd.transport.lane import DECLINE

        entry = self._take_hot(msg.batch_id, peer)
        if entry is None:
            return DECLINE
        self._hot_answer(peer, entry, msg)
        return None

    def _take_hot(self, batch_id: str, peer: str | None = None) -> _HotPart | None:
        with self._hot_lock:
            entry = self._hot.get(batch_id)
            if entry is None or (peer is not None and entry.part.peer != peer):
                return None
            return self._hot.pop(batch_id)

    def _hot_answer(self, peer: str, entry: _HotPart, msg: ExpertResult) -> None:
        answer = msg.hidden.to_array("float32")
        pairs = int((entry.part.call.sel >= 0).sum())
        if answer.shape != (pairs, entry.fan.call.rows.shape[1]):
            self.lane.to_loop(self._ask_again, entry, f"answered {list(answer.shape)} for {pairs} selections")
            return
        took = self.lane.now() - entry.at
        self.chooser.finished(peer, took)
        self.hot_calls.add(took)
        entry.fan.add([(entry.part, answer)])

    def _hot_failed(self, batch_id: str, reason: str) -> None:
        """On the event loop: a hot fan-out's batch got no answer; its experts are asked again by `call`."""
        entry = self._take_hot(batch_id)
        if entry is not None:
            self._ask_again(entry, reason)

    def _ask_again(self, entry: _HotPart, reason: str) -> None:
        part = entry.part
        self.chooser.finished(part.peer, None)
        log.warning("experts %s of block %d: %s did not answer (%s); asking again", list(part.experts),
                    part.call.layer, short_id(part.peer), reason)
        if not spawn(self._nursery, self._answer_again, entry):
            entry.fan.fail(ExpertsUnavailable("the daemon is stopping"))

    async def _answer_again(self, entry: _HotPart) -> None:
        fan, part = entry.fan, entry.part
        try:
            answers = await self._gather(_restrict(fan.call, set(part.experts)))
        except ExpertsUnavailable as e:
            fan.fail(e)
        except Exception as e:  # the step fails for its requests; the daemon goes on
            log.exception("asking again for experts %s of block %d failed", list(part.experts), part.call.layer)
            fan.fail(ExpertsUnavailable(f"{type(e).__name__}: {e}"))
        else:
            fan.add(answers)

    def given_up(self, peer: str, msg: Any, reason: str) -> None:
        """The transport gave up a message: a hot fan-out's batch among them is asked again."""
        if isinstance(msg, ExpertBatch):
            self._hot_failed(msg.batch_id, reason)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The nursery of the router's own asking (hot parts asked again), and its look for hot parts that
        outstayed `result_timeout`; the stats of hot calls are counted here, off the threads that made them."""
        # the event loop's clock, which a hot step's thread reads too (trio.current_time works on the loop only)
        self.chooser.clock = trio.lowlevel.current_clock().current_time
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            try:
                while True:
                    await trio.sleep(min(1.0, self.result_timeout / 4))
                    self._count_hot()
                    now = trio.current_time()
                    with self._hot_lock:
                        late = [b for b, e in self._hot.items() if now - e.at >= self.result_timeout]
                    for batch_id in late:
                        self._hot_failed(batch_id, f"no answer within {self.result_timeout:.0f} s")
            finally:
                self._nursery = None

    def _count_hot(self) -> None:
        while self._hot_done:
            call, seconds, messages, nodes = self._hot_done.popleft()
            stats = self.layers[call.layer]
            stats.fan_out.add(seconds)
            stats.messages += messages
            stats.nodes_hit += nodes
            stats.calls += 1
            stats.rows += len(call.rows)
            for expert, n in tokens_per_expert(call).items():
                stats.tokens[expert] += n

    async def on_result(self, peer: str, msg: ExpertResult) -> None:
        entry = self._take_hot(msg.batch_id, peer)
        if entry is not None:  # a hot fan-out's answer the transport carried
            self._hot_answer(peer, entry, msg)
            return
        pending = self._pending.get(msg.batch_id)
        if pending is None or pending.peer != peer:
            return  # late (already asked elsewhere) or not ours: nothing waits for it
        answer = msg.hidden.to_array("float32")
        if answer.shape[0] != 0 and answer.shape[1] != 0:
            pending.answer = answer
        pending.done.set()

    def on_error(self, msg: Error) -> bool:
        """An Error about one of our batches (the expert refused it): fail that part; True if it was ours."""
        if msg.request_id in self._hot:
            self._hot_failed(msg.request_id, f"{msg.code}: {msg.message}")
            return True
        pending = self._pending.get(msg.request_id)
        if pending is None:
            return False
        pending.error = f"{msg.code}: {msg.message}"
        pending.done.set()
        return True

    def status(self) -> dict[str, Any]:
        self._count_hot()
        out = {}
        for block, s in sorted(self.layers.items()):
            out[str(block)] = {
                "actor": router_actor(block), "calls": s.calls, "rows": s.rows, "messages": s.messages, "local": s.local,
                "nodes_per_call": round(s.nodes_hit / s.calls, 3) if s.calls else None,
                "fan_out_ms_median": s.fan_out.median_ms(),
                "tokens": {str(e): n for e, n in sorted(s.tokens.items())},
            }
        return {"layers": out, "waited_for_plan": self.waits, "dead_peers": sorted(short_id(p) for p in self.dead),
                "hot_call_ms_median": self.hot_calls.median_ms(),
                "latency_ms": {short_id(p): round(self.chooser.estimate(p) * 1e3, 3) for p in sorted(self.chooser.latency)}}


def _thread(block: int) -> str:
    return f"moe router {block}"


def _restrict(call: Any, experts: set[int]) -> Any:
    """`call` with only `experts` selected; rows keep their places, so a retry's parts index `call`."""
    from models.moe import ExpertCall

    mask = np.isin(call.sel, list(experts))
    return ExpertCall(call.layer, call.rows, np.where(mask, call.sel, -1).astype(np.int32),
                      np.where(mask, call.gates, 0.0).astype(np.float32))

