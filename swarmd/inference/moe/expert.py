"""The expert actor: serves `moe-expert-{block}-{idx}` for the routed experts the plan put on this daemon.

An `ExpertBatch` carries the rows one router sends this node for one MoE block and step, each row with
the experts (held here) it selected and their gates; the answer, an `ExpertResult` back to the sender,
is each selected expert's output for its row (one per selection, in row-major order; the router makes the
rows' gated sums), computed on the daemon's compute thread by the loaded `models.expert_shard.ExpertShard`.
A repeated batch is answered from the transport's cache, never computed twice.

A batch that names traced requests (`ExpertBatch.traced`) starts their traces here and records, per request,
`expert.batch` (handler started -> answer ready; the router's `moe.call` and it share a flow id and make one
NTP-style clock sample), inside it `expert.queue` (waiting for the shard and the compute thread) and
`expert.forward` (the experts' compute).

On the hot lane (`swarmd.transport.lane`) a batch is computed on the reader thread it arrived on (`take_hot`),
when the shard holds its experts and tinygrad is free, and its answer goes back on the lane at once; anything
else (a shard still loading, a busy compute thread, a traced request) takes `on_batch` on the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from swarmd.inference.compute import Compute
from swarmd.observe.recent import RecentTimes
from swarmd.observe.spans import SpanRecorder, flow_id
from swarmd.transport.transport import HandlerResult, Send
from swarmd.wire.codec import WireTensor
from swarmd.wire.messages import Error, ExpertBatch, ExpertResult

log = logging.getLogger(__name__)

SHARD_WAIT = 120.0  # s a batch waits for this daemon's experts to finish loading


class ExpertActor:
    def __init__(self, shard: Callable[[], Any], *, compute: Compute, wire_dtype: str | None = None,
                 shard_wait: float = SHARD_WAIT) -> None:
        self._shard = shard  # the loaded ExpertShard now, or None
        self.compute = compute
        self.wire_dtype = wire_dtype
        self.shard_wait = shard_wait
        self.batches = 0
        self.rows = 0
        self.compute_seconds = 0.0
        self.recent = RecentTimes()  # batches' compute times, for the status's median
        self.tokens: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # block -> expert -> rows
        self.recorder: SpanRecorder | None = None  # spans of traced requests
        self._stats_lock = threading.Lock()  # the counts, kept by the event loop and the lane's readers

    async def on_batch(self, peer: str, msg: ExpertBatch) -> HandlerResult:
        from models.moe import ExpertCall

        clock = self.recorder.clock if msg.traced and self.recorder is not None else time.perf_counter
        received = clock()
        sel = msg.expert_ids.to_array().astype(np.int32)
        wanted = set(sel[sel >= 0].tolist())
        shard = await self._wait_for(msg.block, wanted)
        if shard is None:
            held = sorted(self._held(msg.block))
            return Send(peer, Error("experts_missing", f"this daemon does not hold experts {sorted(wanted)} of "
                                    f"block {msg.block} (it holds {held})", request_id=msg.batch_id,
                                    step=msg.step, hop=msg.block))
        call = ExpertCall(msg.block, msg.hidden.to_array("float32"), sel, msg.gates.to_array("float32"))
        started = time.perf_counter()
        answer, computing, computed = await self.compute.run(_timed, clock, shard.expert_outputs, call)
        self._count(msg.block, sel, time.perf_counter() - started)
        result = ExpertResult(msg.batch_id, msg.step, msg.block,
                              WireTensor.from_array(answer.astype(np.float32), self.wire_dtype))
        if msg.traced and self.recorder is not None:
            self._record(peer, msg, sel, received, computing, computed, clock())
        return Send(peer, result)

    def take_hot(self, peer: str, msg: ExpertBatch, reply: Any) -> Any:
        """On a lane's reader thread: compute the batch here if the shard holds its experts and tinygrad is
        free; else DECLINE (`on_batch` on the event loop)."""
        from models.moe import ExpertCall
        from swarmd.transport.lane import DECLINE

        if msg.traced:
            return DECLINE
        shard = self._shard()
        sel = msg.expert_ids.to_array().astype(np.int32)
        if shard is None or not set(sel[sel >= 0].tolist()) <= set(shard.holds(msg.block)):
            return DECLINE
        if not self.compute.hold():
            return DECLINE
        started = time.perf_counter()
        try:
            answer = shard.expert_outputs(ExpertCall(msg.block, msg.hidden.to_array("float32"), sel,
                                                     msg.gates.to_array("float32")))
        finally:
            self.compute.release()
        self._count(msg.block, sel, time.perf_counter() - started)
        return Send(peer, ExpertResult(msg.batch_id, msg.step, msg.block,
                                       WireTensor.from_array(answer.astype(np.float32), self.wire_dtype)))

    def _count(self, block: int, sel: np.ndarray, seconds: float) -> None:
        with self._stats_lock:
            self.compute_seconds += seconds
            self.recent.add(seconds)
            self.batches += 1
            self.rows += len(sel)
            for e in sel[sel >= 0].tolist():
                self.tokens[block][int(e)] += 1

    def _record(self, peer: str, msg: ExpertBatch, sel: np.ndarray, received: float, computing: float,
                computed: float, answered: float) -> None:
        rec = self.recorder
        assert rec is not None
        experts = ",".join(str(e) for e in sorted(set(sel[sel >= 0].tolist())))
        args = {"block": msg.block, "sender": peer, "experts": experts, "rows": len(sel)}
        for rid, step in zip(msg.traced, msg.traced_steps, strict=True):
            rec.trace(rid)
            rec.add(rid, "expert.batch", "experts", received, answered, step=step, flow=flow_id(msg.key()), **args)
            rec.add(rid, "expert.queue", "experts", received, computing, step=step, **args)
            rec.add(rid, "expert.forward", "experts", computing, computed, step=step, **args)

    def _held(self, block: int) -> tuple[int, ...]:
        shard = self._shard()
        return shard.holds(block) if shard is not None else ()

    async def _wait_for(self, block: int, wanted: set[int]) -> Any:
        """The shard once it holds `wanted` (a plan may still be loading), or None after `shard_wait`."""
        with trio.move_on_after(self.shard_wait):
            while True:
                shard = self._shard()
                if shard is not None and wanted <= set(shard.holds(block)):
                    return shard
                await trio.sleep(0.05)
        return None

    def status(self) -> dict[str, Any]:
        shard = self._shard()
        held = {} if shard is None else {str(b): list(es) for b, es in sorted(shard.experts.items())}
        with self._stats_lock:
            return {"held": held, "batches": self.batches, "rows": self.rows,
                    "compute_ms": round(self.compute_seconds * 1e3, 1),
                    "compute_ms_median": self.recent.median_ms(),
                    "tokens": {str(b): {str(e): n for e, n in sorted(by.items())}
                               for b, by in sorted(self.tokens.items())}}


def _timed(clock: Callable[[], float], compute: Callable[[Any], np.ndarray], call: Any) -> tuple[np.ndarray, float, float]:
    """`compute(call)` on the compute thread, with when it began and ended there (for `expert.forward`)."""
    start = clock()
    answer = compute(call)
    return answer, start, clock()
