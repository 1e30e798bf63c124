"""The stage actor: runs this daemon's blocks for every request passing through, batching what waits together.

Messages come from the actor transport: a `Forward` (token ids on stage 0, hidden states on the others), on
stage 0 the `Token` the last stage sampled (the input of the next step), and `Cancel`. `StageBook`
(`swarmd.inference.stage.book`) decides what each means; this module does the I/O around it:

    handler: book.on_forward(msg) -> Work -> Job -> (batch on the compute thread) -> book.complete -> Sends

Jobs queued together run as one batch, one `StageModel.forward` on the compute thread
(`swarmd.inference.stage.batch`): decode steps of several requests become one batched forward. A worker task
takes every job queued since its last run; when it is idle, the handler starts the batch itself. A short
decode step holding every request of the stage runs on the event loop's thread instead (`_inlines`). A MoE
stage whose experts live elsewhere runs in segments, asking the router (`experts`) between two; calls that
this daemon's own shard can answer are answered on the compute thread (`swarmd.inference.moe.local`).
The first handler of a finished batch posts every job's outputs together (`ActorTransport.post_all`, one write
a peer); each handler returns its own, which the transport caches under the message's key, so a repeated
frame gets the same answer and never touches the KV cache twice.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import trio

from swarmd.inference.compute import Compute
from swarmd.inference.moe.local import LocalExperts
from swarmd.inference.stage.batch import ExpertsFailed, advance_here, run_batch
from swarmd.inference.stage.book import StageBook, StageRefusal, Work
from swarmd.inference.stage.job import Batch, Job, Loaded
from swarmd.observe.spans import SpanRecorder, record_stage_step
from swarmd.transport.transport import HandlerResult, Posted, Send, as_sends
from swarmd.wire.codec import WireError
from swarmd.wire.messages import Cancel, Error, Forward, Token

log = logging.getLogger(__name__)

SETTLE = 0.002  # s a stage waits for the rest of a convoy of decode steps sent together by the previous stage
MAX_GATHER = 1.0  # s stage 0 waits at most for other requests' tokens to form one batch


class StageStats:
    """Counters for status and benchmarks: batches and their sizes, and the times of recent steps.

    A step's times are perf_counter seconds, one clock for all processes of a machine, so the steps of one
    request on different daemons line up: the gap between one stage's `sent` and the next stage's
    `received` is the hop (encode, write, read, decode, checks, admission)."""

    def __init__(self, keep: int = 1024) -> None:
        self.batches = 0
        self.jobs = 0
        self.largest_batch = 0
        self.decode_batch: deque[int] = deque(maxlen=keep)  # sizes of recent batches of decode steps
        self.steps: deque[tuple[str, int, int, int, float, float, float, float, float]] = deque(maxlen=keep)
        # moved requests that continued an attempt: here they kept its KV cache (positions kept), or rebuilt it
        self.kv_adopted = 0
        self.kv_kept_positions = 0
        self.kv_rebuilt = 0

    def record_batch(self, jobs: Sequence[Job]) -> None:
        self.batches += 1
        self.jobs += len(jobs)
        self.largest_batch = max(self.largest_batch, len(jobs))
        if all(j.work.rows == 1 for j in jobs):
            self.decode_batch.append(len(jobs))

    def record_resume(self, work: Work) -> None:
        if work.adopt:
            self.kv_adopted += 1
            self.kv_kept_positions += work.start_pos
        else:
            self.kv_rebuilt += 1

    def record_step(self, job: Job, sent: float) -> None:
        w = job.work
        self.steps.append((w.request_id, w.step, w.rows, job.batch, job.received, job.taken, job.started, job.ended,
                           sent))

    def to_json(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "jobs": self.jobs,
            "largest_batch": self.largest_batch,
            "decode_batch_mean": round(statistics.fmean(self.decode_batch), 3) if self.decode_batch else None,
            "kv_adopted": self.kv_adopted, "kv_kept_positions": self.kv_kept_positions, "kv_rebuilt": self.kv_rebuilt,
            "recent_steps": [dict(zip(STEP_FIELDS, step, strict=True)) for step in self.steps],
        }


STEP_FIELDS = ("request_id", "step", "rows", "batch", "received", "taken", "started", "ended", "sent")


# How long a Forward sent under a newer plan waits for that plan to reach this daemon.
PLAN_CATCH_UP_S = 2.0


class StageActor:
    """Serves `Forward`, `Token` (hop 0) and `Cancel` for the stage `current()` names."""

    def __init__(self, current: Callable[[], Loaded | None], *, compute: Compute, max_context: int,
                 wire_dtype: str | None, idle_timeout: float,
                 experts: Callable[..., Awaitable[np.ndarray]] | None = None,
                 local_experts: LocalExperts | None = None,
                 post_all: Callable[[Sequence[Send]], Awaitable[None]],
                 plan_epoch: Callable[[], int] | None = None, inline_step_s: float = 0.0) -> None:
        self._current = current
        # the epoch of the plan this daemon has accepted (by default, that of the stage it runs)
        self._plan_epoch = plan_epoch or self._loaded_epoch
        self.experts = experts  # the MoE router: (ExpertCall, traced) -> the gate-weighted expert sum
        self.local_experts = local_experts  # this daemon's own shard, for the calls it can answer whole
        self.compute = compute  # the daemon's one thread for tinygrad
        self.max_context = max_context
        self.wire_dtype = wire_dtype
        self.idle_timeout = idle_timeout
        self.book: StageBook | None = None
        self._book_key: tuple[int, int, int] | None = None  # (id(model), hop, n_stages) the book belongs to
        self._model: Any = None  # the model the book belongs to
        self._jobs: list[Job] = []
        self._frees: list[tuple[Any, str]] = []  # (model, request id) whose KV caches to free
        self._wake = trio.Event()
        self._idle = False  # the worker waits for work (a handler may then start a batch itself)
        self._inflight: Batch | None = None  # the batch on the compute thread
        self._first_queued = 0.0
        self.periods: deque[float] = deque(maxlen=64)  # stage 0: recent times for a token to come round
        self.stats = StageStats()
        self.recorder: SpanRecorder | None = None  # spans of traced requests
        # A decode batch whose last run of the same size took at most this long runs on the event loop's thread
        # when the compute thread is idle (`ComputeThread.run_inline`); 0: never.
        self.inline_step_s = inline_step_s
        self._decode_s: dict[int, float] = {}  # batch size -> the current model's last decode step of it, s
        self._post_all = post_all  # the transport's: a batch's outputs leave together

    def _loaded_epoch(self) -> int:
        loaded = self._current()
        return loaded.registry.epoch if loaded is not None else 0

    # --- handlers --------------------------------------------------------------------------------------

    async def on_forward(self, peer: str, msg: Forward) -> HandlerResult:
        received = time.perf_counter()
        if msg.epoch > self._plan_epoch():
            # The head saw a new plan first (it gossips to everyone at once): wait a moment for it here
            # rather than refuse, which would send the request round another move.
            with trio.move_on_after(PLAN_CATCH_UP_S):
                while msg.epoch > self._plan_epoch():  # noqa: ASYNC110 - the plan arrives through gossip
                    await trio.sleep(0.01)
        try:
            loaded, book = self._book()
            work = book.on_forward(msg, trio.current_time())
        except StageRefusal as e:
            return _refusal(msg.head or peer, msg.request_id, msg.step, msg.hop, e)
        if msg.resume_of:  # the attempt it continues is over here: adopted by `work`, or (busy, say) dropped
            self.stats.record_resume(work)
            if book.cancel(msg.resume_of):
                self._free(loaded.model, msg.resume_of)
        return await self._run(loaded, book, work, received)

    async def on_token(self, peer: str, msg: Token) -> HandlerResult:
        """Stage 0's copy of a sampled token: run the next step."""
        received = time.perf_counter()
        try:
            loaded, book = self._book()
            state = book.requests.get(msg.request_id)
            if state is not None and not state.busy and msg.step > 0:
                self.periods.append(trio.current_time() - state.last_active)  # once round the rest of the chain
            work = book.on_token(msg, trio.current_time())
        except StageRefusal as e:
            head = self.book.head_of(msg.request_id) if self.book else None
            return _refusal(head or peer, msg.request_id, msg.step + 1, 0, e)
        return await self._run(loaded, book, work, received)

    async def on_cancel(self, peer: str, msg: Cancel) -> None:
        if self.book is not None and self.book.cancel(msg.request_id):
            self._free(self._model, msg.request_id)

    def head_of(self, request_id: str) -> str | None:
        return self.book.head_of(request_id) if self.book else None

    def queue_state(self) -> dict[str, Any]:
        """What waits here now (for `/api/v0/pipeline`): a stage that holds requests but computes nothing shows
        where they are stuck."""
        now = time.perf_counter()
        batch = self._inflight
        return {"queued": len(self._jobs), "frees_queued": len(self._frees), "worker_idle": self._idle,
                "in_compute": None if batch is None else {
                    "jobs": len(batch.jobs), "first_segment_in": batch.arrived.is_set(),
                    "for_s": round(now - min((j.taken for j in batch.jobs), default=now), 3)}}

    def forget_heads(self, gone: set[str]) -> list[str]:
        """Free the KV caches of requests whose head died or left: no one will read their tokens."""
        if self.book is None or not gone:
            return []
        dropped = self.book.drop_heads(gone)
        for rid in dropped:
            log.info("request %s: its head is gone; freed its KV cache", rid)
            self._free(self._model, rid)
        return dropped

    # --- the book of the stage loaded now ----------------------------------------------------------------

    def _book(self) -> tuple[Loaded, StageBook]:
        loaded = self._current()
        if loaded is None:
            raise StageRefusal("not_ready", "this daemon has no loaded stage in the current plan")
        key = (id(loaded.model), loaded.hop, loaded.registry.n_stages)
        if key != self._book_key:
            if self.book is not None:
                old = self._model
                for rid in self.book.clear():
                    self._free(old, rid)
                log.info("stage %d of %d now (blocks %d-%d); requests of the old stage dropped", loaded.hop,
                         loaded.registry.n_stages, loaded.model.start, loaded.model.end - 1)
            self.book = StageBook(loaded.hop, loaded.registry.n_stages, min(self.max_context, loaded.model.max_context),
                                  loaded.model.vocab_size, self.wire_dtype)
            self._book_key = key
            self._model = loaded.model
            self._decode_s.clear()  # a new model's batch sizes are all unseen
        assert self.book is not None
        return loaded, self.book

    # --- the worker ------------------------------------------------------------------------------------

    async def _run(self, loaded: Loaded, book: StageBook, work: Work, received: float) -> HandlerResult:
        job = Job(work, loaded.model, loaded, book, received)
        if not self._jobs:
            self._first_queued = trio.current_time()
        self._jobs.append(job)
        if self._idle and self._inflight is None and not self._must_wait():
            # The batch starts now, not after the worker's wake-up; the worker is woken when the batch's first
            # segment is done (`_segment_done`), so no task runs beside the compute thread's start. A short
            # decode step may run right here instead (`_inlines`): then nothing yields between its end and the
            # output's write to the next stage, which goes before the reader's ack of this frame.
            self._launch()
        else:
            self._wake.set()
        if not job.done.is_set():
            await job.done.wait()
        if job.sends is None:
            # The first of the batch's handlers to run builds every job's outputs and posts them in one go: the
            # frames for one peer leave in one write, and the next stage reads them at once, as one batch. The
            # chain's inputs go first and apart from the head's copies: on a daemon that is both stage 0 and a
            # head, the next step then starts before the head's work (a read takes one write's TLS record).
            built: list[Send] = []
            for j in job.group or [job]:
                if j.sends is None:
                    j.sends = as_sends(self._outputs(j))
                    built += j.sends
            chain: list[Send] = []
            heads: list[Send] = []
            for s in built:
                (chain if _feeds_the_chain(s.msg) else heads).append(s)
            for part in (chain, heads):
                if part:
                    await self._post_all(part)
        return Posted(job.sends or ())

    def _outputs(self, job: Job) -> HandlerResult:
        """What a finished job sends: the next stage's input or the sampled token, or its error to the head."""
        work, loaded, book = job.work, job.loaded, job.book
        assert loaded is not None and book is not None
        if book is not self.book or work.request_id not in book.requests:
            return None  # the stage was replaced meanwhile (a new plan): the request is lost here
        if job.error is not None:
            out = book.fail(work, *job.error)
            self._free(loaded.model, work.request_id)
            return Send(out.peer, out.msg) if out else None
        if job.output is None:
            return None  # the daemon is stopping: the batch was abandoned
        registry = loaded.registry
        outs = book.complete(work, job.output, next_peer=registry.next_peer(book.hop),
                             first_peer=registry.stage_peer(0), now=trio.current_time())
        if work.request_id not in book.requests:  # cancelled while the model ran it
            self._free(loaded.model, work.request_id)
        try:
            for o in outs:
                o.msg.check()
        except WireError as e:  # our bug, but one request's, not the daemon's: it fails, the daemon goes on
            log.exception("stage %d built an invalid %s", book.hop, type(outs[0].msg).__name__)
            failed = book.fail(work, "internal", f"stage {book.hop} could not build its output: {e}")
            self._free(loaded.model, work.request_id)
            return Send(failed.peer, failed.msg) if failed else None
        sent = time.perf_counter()
        self.stats.record_step(job, sent)
        if self.recorder is not None and self.recorder.wants(work.request_id):
            record_stage_step(self.recorder, job, sent, book.hop)
        return [Send(o.peer, o.msg) for o in outs]

    def _free(self, model: Any, request_id: str) -> None:
        if model is not None:
            self._frees.append((model, request_id))
            self._wake.set()

    def _take_batch(self) -> list[Job]:
        """Every queued job of one model, one per request (a request's next step waits for the next batch)."""
        model = self._jobs[0].model
        batch: list[Job] = []
        rest: list[Job] = []
        seen: set[str] = set()
        for job in self._jobs:
            if job.model is model and job.work.request_id not in seen:
                seen.add(job.work.request_id)
                batch.append(job)
            else:
                rest.append(job)
        self._jobs = rest
        return batch

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire_idle)
            task_status.started(self)
            while True:
                self._idle = True
                try:
                    await self._wake.wait()
                except trio.Cancelled:  # the daemon stops: a batch a handler launched must not hold its handlers
                    if self._inflight is not None:
                        for job in self._inflight.jobs:
                            job.done.set()
                    raise
                self._idle = False
                self._wake = trio.Event()
                while self._jobs or self._frees or self._inflight is not None:
                    if self._inflight is None:
                        await self._gather()
                        self._launch()
                    batch = self._inflight
                    assert batch is not None
                    try:  # cancelled only when the daemon stops: then it does not wait for a long prefill
                        await self._see_through(batch)
                    except Exception as e:  # a bug in the model code: these requests fail, the daemon goes on
                        log.exception("stage batch of %d failed", len(batch.jobs))
                        for job in batch.jobs:
                            if job.output is None and job.error is None:
                                job.error = ("internal", f"the stage failed: {type(e).__name__}: {e}")
                    finally:
                        self._inflight = None
                        for job in batch.jobs:
                            job.done.set()
                    if batch.jobs:
                        self.stats.record_batch(batch.jobs)

    def _launch(self) -> None:
        """Take the next batch (and the KV caches to free) and start it on the compute thread."""
        frees, self._frees = self._frees, []
        jobs = self._take_batch() if self._jobs else []
        taken = time.perf_counter()
        for job in jobs:
            job.taken, job.group = taken, jobs
        batch = self._inflight = Batch(jobs, run_batch(jobs, frees))
        try:
            if self._inlines(jobs):
                ran, answer, error = self.compute.run_inline(advance_here, batch.steps, None, None, self.local_experts)
                if ran:
                    self._segment_done(batch, answer, error)
                    return
            self.compute.submit(advance_here, batch.steps, None, None, self.local_experts,
                                then=partial(self._segment_done, batch))
        except RuntimeError as e:  # the compute handle is closed (the daemon is stopping): the jobs fail
            self._segment_done(batch, None, e)

    def _inlines(self, jobs: Sequence[Job]) -> bool:
        """Whether a batch of these jobs runs on the event loop's thread: decode steps only (a prefill can take
        seconds), only once a batch of this size was seen to take at most `inline_step_s` (its first run
        captures the jitted graph, which can also take seconds), and only when the batch holds every request
        of the stage. Frames of requests not in it may land meanwhile: on the compute thread's time, the loop
        reads and admits them while the model runs; after an inline step, that work would come between the
        batch's outputs and spread them over more than the next stage's settle window (smaller batches down the
        chain: docs/BENCHMARKS.md, "A short decode step on the event loop's own thread")."""
        book = self.book
        if (not jobs or self.inline_step_s <= 0 or book is None or len(jobs) < len(book.requests)
                or any(j.work.rows != 1 for j in jobs)):
            return False
        took = self._decode_s.get(len(jobs)) if jobs[0].model is self._model else None
        return took is not None and took <= self.inline_step_s

    def _segment_done(self, batch: Batch, answer: tuple[bool, Any] | None, error: BaseException | None) -> None:
        jobs = batch.jobs
        if (jobs and answer is not None and answer[0] and jobs[0].ended and jobs[0].model is self._model
                and all(j.work.rows == 1 for j in jobs)):
            self._decode_s[len(jobs)] = jobs[0].ended - jobs[0].started
        self._count_local_answers(batch)
        _first_segment_done(batch, answer, error)
        if self._idle and batch is self._inflight and error is None and batch.answer[0]:
            # A batch a handler launched while the worker slept, done in one segment (the usual decode step):
            # finish it here rather than wake the worker, whose run would share the next scheduler pass with
            # the handlers and, in trio's random order, come first half the time.
            self._inflight = None
            if batch.jobs:
                self.stats.record_batch(batch.jobs)
            if self._jobs or self._frees:
                self._wake.set()
            return
        self._wake.set()  # the worker sees the batch through (a handler may have launched it while it slept)

    async def _see_through(self, batch: Batch) -> None:
        """Wait for the batch's first segment; for a MoE stage whose experts live elsewhere, ask them and run
        the next segment, until the batch is done."""
        await batch.arrived.wait()
        if batch.error is not None:
            raise batch.error
        done, call = batch.answer
        rec = self.recorder
        traced = {j.work.request_id: j.work.step for j in batch.jobs if rec is not None and rec.wants(j.work.request_id)}
        while not done:
            answer: np.ndarray | None = None
            error: Exception | None = None
            if self.experts is None:
                error = ExpertsFailed("this stage's experts live elsewhere and the daemon has no MoE router")
            else:
                try:
                    answer = await self.experts(call, traced) if traced else await self.experts(call)
                except Exception as e:  # the step fails for these requests (see run_batch), the daemon goes on
                    error = ExpertsFailed(f"{type(e).__name__}: {e}")
            done, call = await self.compute.run(advance_here, batch.steps, answer, error, self.local_experts)
            self._count_local_answers(batch)

    def _count_local_answers(self, batch: Batch) -> None:
        """Hand the router the expert calls this daemon's shard answered during the batch's last segment (none
        on a dense stage's step: nothing to do there)."""
        if self.local_experts is not None and self.local_experts.answered:
            rec = self.recorder
            self.local_experts.count({j.work.request_id: j.work.step for j in batch.jobs
                                      if rec is not None and rec.wants(j.work.request_id)})

    def _must_wait(self) -> bool:
        """Whether `_gather` would wait for other requests' decode steps now."""
        book = self.book
        if book is None or not self._jobs or any(j.work.rows != 1 for j in self._jobs):
            return False
        return any(not st.busy for st in book.requests.values())

    async def _gather(self) -> None:
        """Let the decode steps of other requests here catch up, so that they run as one batch.

        Requests this stage holds that are not queued are elsewhere in the chain. Stage 0 waits for them up to
        the time a token takes to come round (once they arrive together they stay together: a convoy); the
        other stages wait only for frames of the same convoy still landing (SETTLE). A lone request, or a
        prefill, never waits."""
        book = self.book
        if book is None or not self._must_wait():
            return
        window = min(statistics.median(self.periods), MAX_GATHER) if book.is_first and self.periods else SETTLE
        deadline = self._first_queued + window
        while any(not st.busy for st in book.requests.values()) and trio.current_time() < deadline:
            with trio.move_on_at(deadline):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _expire_idle(self) -> None:
        while True:
            await trio.sleep(max(1.0, self.idle_timeout / 4))
            if self.book is not None:
                for rid in self.book.expire(trio.current_time(), self.idle_timeout):
                    log.info("request %s idle for %.0f s: freed its KV cache", rid, self.idle_timeout)
                    self._free(self._model, rid)


def _feeds_the_chain(msg: Any) -> bool:
    """Whether `msg` is a stage's input (a `Forward`, or stage 0's copy of a token), not the head's."""
    return isinstance(msg, Forward) or (isinstance(msg, Token) and msg.hop == 0)


def _refusal(head: str, request_id: str, step: int, hop: int, e: StageRefusal) -> Send:
    log.info("refused step %d of %s: %s: %s", step, request_id, e.code, e)
    return Send(head, Error(e.code, str(e), request_id=request_id, step=step, hop=hop))


def _first_segment_done(batch: Batch, answer: tuple[bool, Any] | None, error: BaseException | None) -> None:
    """On the event loop, as the compute thread finishes a batch's first segment: a finished batch wakes its
    handlers at once. Must not raise."""
    batch.error = error
    if error is None and answer is not None:
        batch.answer = answer
        if answer[0]:
            for job in batch.jobs:
                job.done.set()
    batch.arrived.set()
