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

On a token's critical path the step runs where its input lands: `take_hot` is the stage's handler on the hot
lane (`swarmd.transport.lane`), called on the reader thread of the stream the `Forward` (or stage 0's `Token`)
arrived on. When the stage is idle and the step is one the event loop would run inline (a decode step of the
only request here, of a batch size measured short, not traced), it runs right there and its output is written
to the next stage's lane before the frame is acked; anything else is declined and takes the handler path above.
A MoE step whose experts live elsewhere is handed to the worker after its first segment. The state shared with
the event loop (the book, the queue, the batch in flight) is changed under `_lock` on both sides.
"""

from __future__ import annotations

import logging
import statistics
import threading
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
from swarmd.inference.stage.next_step import Expected, NextStep, Ran, expected_after
from swarmd.observe.spans import SpanRecorder, record_stage_step
from swarmd.transport.lane import DECLINE, LATER, run_safely
from swarmd.transport.transport import HandlerResult, Posted, Send, as_sends
from swarmd.wire.codec import WireError
from swarmd.wire.messages import Cancel, Error, Forward, Speculate, Token

log = logging.getLogger(__name__)

SETTLE = 0.002  # s a stage waits for the rest of a convoy of decode steps sent together by the previous stage
HOT_RESUME_WAIT = 0.01  # s the thread that brings a hot step's last expert answer waits for tinygrad
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
        self.steps: deque[tuple[str, int, int, int, float, float, float, float, float, float]] = deque(maxlen=keep)
        # moved requests that continued an attempt: here they kept its KV cache (positions kept), or rebuilt it
        self.kv_adopted = 0
        self.kv_kept_positions = 0
        self.kv_rebuilt = 0
        self.prefill_chunks_deferred = 0  # prefills whose next chunk waited for the next batch (others decoding)

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
                           sent, job.arrived))

    def to_json(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "jobs": self.jobs,
            "largest_batch": self.largest_batch,
            "decode_batch_mean": round(statistics.fmean(self.decode_batch), 3) if self.decode_batch else None,
            "kv_adopted": self.kv_adopted, "kv_kept_positions": self.kv_kept_positions, "kv_rebuilt": self.kv_rebuilt,
            "prefill_chunks_deferred": self.prefill_chunks_deferred,
            "recent_steps": [dict(zip(STEP_FIELDS, step, strict=True)) for step in self.steps],
        }


# `arrived`: when a lane's reader got the step's bytes off the socket (0 for a step not run on the lane)
STEP_FIELDS = ("request_id", "step", "rows", "batch", "received", "taken", "started", "ended", "sent", "arrived")


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
        # ... and from a hot step's thread: (ExpertCall, LocalExperts) -> a FanOut, or None (`MoERouter.fan_out`),
        # told when its answer is taken (`MoERouter.finished_hot`)
        self.experts_hot: Callable[..., Any] | None = None
        self.experts_done: Callable[[Any], None] | None = None
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
        self._decode_s: dict[int, float] = {}  # rows -> the current model's last decode batch of them, s
        self._post_all = post_all  # the lane's or the transport's: a batch's outputs leave together
        self._lock = threading.RLock()  # the book, the queue and the batch in flight, with a lane's reader
        self._loop_thread = threading.get_ident()
        self._token: trio.lowlevel.TrioToken | None = None
        self._now: Callable[[], float] = trio.current_time  # the event loop's clock, readable from any thread
        self._waiters: dict[str, trio.Event] = {}  # new requests waiting for a KV slot, by request id
        self._ran_hot: tuple[Forward | Token, Job] | None = None  # the last step `take_hot` ran whole
        self.next_step = NextStep(self.take_next, self.expect_after)  # the lane's shortcut to the step after

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
            with self._lock:
                loaded, book = self._book()
                wait = book.must_wait(msg)
            if wait:
                if not await self._wait_for_slot(book, msg.request_id, msg.head or peer):
                    return None  # cancelled while it waited, or the stage changed under it
                received = time.perf_counter()
            with self._lock:
                loaded, book = self._book()
                state = book.requests.get(msg.request_id)
                if book.is_first and state is not None and not state.busy and msg.sampling is None:
                    self.periods.append(trio.current_time() - state.last_active)  # a speculative step came round
                work = book.on_forward(msg, trio.current_time())
                if msg.resume_of:  # the attempt it continues is over here: adopted by `work`, or (busy) dropped
                    self.stats.record_resume(work)
                    if book.cancel(msg.resume_of):
                        self._free(loaded.model, msg.resume_of)
        except StageRefusal as e:
            with self._lock:
                self._admit_in_line()  # a slot held for it is free again
            return _refusal(msg.head or peer, msg.request_id, msg.step, msg.hop, e)
        return await self._run(loaded, book, work, received)

    async def on_token(self, peer: str, msg: Token) -> HandlerResult:
        """Stage 0's copy of a sampled token: run the next step."""
        received = time.perf_counter()
        with self._lock:
            try:
                loaded, book = self._book()
                work = self._token_work(book, msg, trio.current_time())
            except StageRefusal as e:
                head = self.book.head_of(msg.request_id) if self.book else None
                return _refusal(head or peer, msg.request_id, msg.step + 1, 0, e)
        return await self._run(loaded, book, work, received)

    async def on_speculate(self, peer: str, msg: Speculate) -> None:
        """A speculative request's head takes the loop back from the chain (the last stage sends it the next step)."""
        with self._lock:
            if self.book is not None:
                self.book.drive(msg.request_id)

    def _token_work(self, book: StageBook, msg: Token, now: float) -> Work:
        state = book.requests.get(msg.request_id)
        if state is not None and not state.busy and msg.step > 0:
            self.periods.append(now - state.last_active)  # once round the rest of the chain
        return book.on_token(msg, now)

    async def on_cancel(self, peer: str, msg: Cancel) -> None:
        with self._lock:
            if self.book is not None and self.book.cancel(msg.request_id):
                self._free(self._model, msg.request_id)
            batch = self._inflight
            if batch is not None and self._all_cancelled(batch):
                self._stop_waiting(batch)
            self._admit_in_line()

    def _all_cancelled(self, batch: Batch) -> bool:
        """Whether every request of `batch` is cancelled or gone (under `_lock`)."""
        book = self.book
        return book is not None and all(
            (st := book.requests.get(j.work.request_id)) is None or st.cancelled for j in batch.jobs)

    @staticmethod
    def _stop_waiting(batch: Batch) -> None:
        """Nobody wants `batch`'s outputs: its wait for remote experts ends now, failing the step (which frees
        what it holds), rather than holding the stage until the experts answer or time out."""
        if batch.asking is not None:
            batch.asking.cancel()
        if batch.fan is not None:
            batch.fan.fail(ExpertsFailed("every request of the step was cancelled"))

    # --- the hot lane: a step on the reader thread of the stream its input came on --------------------------

    def take_hot(self, peer: str, msg: Forward | Token, reply: Any) -> Any:
        """On a lane's reader thread: run `msg`'s step here and return its outputs (the lane sends them, then
        acks), or DECLINE (the transport's handler takes it on the event loop), or LATER (a MoE step the worker
        finishes; `reply` then sends them)."""
        received = time.perf_counter()
        if self.inline_step_s <= 0 or self._token is None or not _decode_shaped(msg) or (
                self.recorder is not None and self.recorder.wants(msg.request_id)):
            return DECLINE
        with self._lock:
            started = self._hot_start(msg, received, reply)
        if started is None:
            return DECLINE
        job, batch = started
        result = self._hot_run(batch, job, reply, None)
        if result is not LATER:
            self._ran_hot = (msg, job)
        return result

    def expect_after(self, peer: str, msg: Forward | Token) -> Expected | None:
        """The frame of the step after `msg`'s, if `take_hot` just ran it whole and the general path would run
        the next one the same way (`NextStep`'s `learn`)."""
        ran = self._ran_hot
        if ran is None or ran[0] is not msg:
            return None
        job = ran[1]
        if job.book is None or job.loaded is None:
            return None
        return expected_after(peer, msg, job.work.rows, job.book, job.loaded)

    def take_next(self, expected: Expected, body: bytes, arrived: float) -> Ran | Any:
        """On a lane's reader: the step `expected` names, whose frame `body` is (`NextStep`), run as `take_hot`
        runs a step, to the book's transition after its model (`Ran.finish` builds its outputs); DECLINE when
        the stage is not as the step before left it."""
        received = time.perf_counter()
        data = expected.input(body)
        with self._lock:
            started = self._next_start(expected, data, received, arrived)
        if started is None:
            return DECLINE
        job, batch = started
        error = self._hot_advance(batch, job, None, None)  # (a stage with no MoE block: never LATER)
        booked = False
        if error is None and job.error is None and job.output is not None:
            with self._lock:
                booked = self._book_ahead(job)
        return Ran(job.work, job.output if booked else None, partial(self._hot_finish, batch, job, error))

    def _book_ahead(self, job: Job) -> bool:
        """With `_lock` held: the book's transition of a step run whole, before its outputs are built (so a
        stage that gets its next input, however soon, finds it done); False if the request is gone here."""
        book, work, loaded = job.book, job.work, job.loaded
        assert book is not None and loaded is not None and job.output is not None
        if book is not self.book or work.request_id not in book.requests:
            return False
        job.booked = True
        if book.completed(work, job.output, self._now()):
            return True
        self._free(loaded.model, work.request_id)  # cancelled while the model ran it
        return False

    def _next_start(self, e: Expected, data: np.ndarray, received: float, arrived: float) -> tuple[Job, Batch] | None:
        """With `_lock` held: `_hot_start` for the step `e`, whose frame's every other field passed the general
        path's checks with the step before."""
        loaded, book = self._current(), self.book
        if (book is not e.book or loaded is None or loaded.model is not e.model
                or loaded.registry is not e.registry):
            return None
        return self._hot_begin(loaded, book, received, arrived, lambda now: book.next_decode(
            e.request_id, e.step, e.start_pos, e.epoch, data, now))

    def _hot_run(self, batch: Batch, job: Job, reply: Any, fan: Any) -> Any:
        """Run (tinygrad held) a hot step's segments from where it stands (`fan`: the answer to the expert call
        it waits on): its outputs once done; LATER when a MoE layer's answers are still on their way (whoever
        brings the last resumes it) or the step was handed to the worker."""
        error = self._hot_advance(batch, job, reply, fan)
        return error if error is LATER else self._hot_finish(batch, job, error)

    def _hot_advance(self, batch: Batch, job: Job, reply: Any, fan: Any) -> Any:
        """`_hot_run`'s model part, tinygrad released after: the error that ended the step (None if none), or
        LATER."""
        error: BaseException | None = None
        try:
            if fan is None:
                done, call = advance_here(batch.steps, None, None, self.local_experts)
            else:
                done, call = self._resume_with(batch, fan)
            while not done:  # a MoE block whose experts live elsewhere: fanned out from here
                fan = self.experts_hot(call, self.local_experts) if self.experts_hot is not None else None
                if fan is None:  # an expert with no live holder: the worker's router waits for a plan
                    job.reply = reply
                    self._to_loop(self._hot_continues, batch, call)
                    return LATER
                batch.fan = fan
                if fan.wait_then(partial(self._hot_resume, batch, job, reply)):
                    return LATER
                done, call = self._resume_with(batch, fan)
        except BaseException as e:  # run_batch catches the model's errors: this is our bug, one request's
            error = e
        finally:
            self.compute.release()
        return error

    def _resume_with(self, batch: Batch, fan: Any) -> tuple[bool, Any]:
        if self.experts_done is not None:
            self.experts_done(fan)
        error = ExpertsFailed(str(fan.error)) if fan.error is not None else None
        return advance_here(batch.steps, None if error else fan.out, error, self.local_experts)

    def _hot_resume(self, batch: Batch, job: Job, reply: Any, fan: Any) -> None:
        """The last answer of a hot step's fan-out is in (on the thread that brought it): go on here if tinygrad
        is free, else hand the step to the worker."""
        if threading.get_ident() == self._loop_thread or not self.compute.hold(wait=HOT_RESUME_WAIT):
            job.reply = reply
            batch.resume = (fan.out, ExpertsFailed(str(fan.error)) if fan.error is not None else None)
            if self.experts_done is not None:
                self.experts_done(fan)
            self._to_loop(self._hot_continues, batch, None)
            return
        result = self._hot_run(batch, job, reply, fan)
        if result is not LATER:
            reply.done(result)

    def _hot_start(self, msg: Forward | Token, received: float, reply_arrived: Any) -> tuple[Job, Batch] | None:
        """With `_lock` held: book the step and take tinygrad if the stage is idle and the step is short and
        alone (the rule of `_inlines`); None to decline, with nothing changed."""
        loaded, book = self._current(), self.book
        if loaded is None or book is None or (id(loaded.model), loaded.hop, loaded.registry.n_stages) != self._book_key:
            return None
        if isinstance(msg, Forward) and msg.epoch > self._plan_epoch():
            return None
        if msg.request_id not in book.requests:
            return None

        def work(now: float) -> Work | None:
            try:
                return self._token_work(book, msg, now) if isinstance(msg, Token) else book.on_forward(msg, now)
            except StageRefusal:  # the handler path refuses it, with the reason, to the head
                return None

        return self._hot_begin(loaded, book, received, getattr(reply_arrived, "arrived", 0.0), work)

    def _hot_begin(self, loaded: Loaded, book: StageBook, received: float, arrived: float,
                   work_of: Callable[[float], Work | None]) -> tuple[Job, Batch] | None:
        """With `_lock` held, a hot step's request checked: if the stage is idle, holds only that request and its
        decode steps are short, take tinygrad and book the step (`work_of(now)`; None: it does not run now) as the
        one batch in flight. None to decline, with nothing changed."""
        if not (self._idle and self._inflight is None and not self._jobs and not self._frees):
            return None
        took = self._decode_s.get(1)
        if len(book.requests) != 1 or took is None or took > self.inline_step_s or not self.compute.hold():
            return None
        work = work_of(self._now())
        if work is None:
            self.compute.release()
            return None
        job = Job(work, loaded.model, loaded, book, received)
        job.taken = time.perf_counter()
        job.group = [job]
        job.arrived = arrived
        batch = self._inflight = Batch([job], run_batch([job], []), hot=True)
        return job, batch

    def _hot_finish(self, batch: Batch, job: Job, error: BaseException | None, written: float = 0.0) -> list[Send]:
        """On the reader thread, the step done: its outputs (the chain's input first; `written`: when that one
        was written ahead), the stage idle again."""
        if self.local_experts is not None and self.local_experts.answered:
            self._to_loop(self._count_local_answers, batch)
        with self._lock:
            if error is None and job.ended and job.model is self._model:
                self._decode_s[1] = job.ended - job.started
            elif error is not None:
                log.error("a hot step of %s failed", job.work.request_id, exc_info=error)
                job.error = ("internal", f"the stage failed: {type(error).__name__}: {error}")
            sends = as_sends(self._outputs(job, written))
            job.sends = sends
            if self._inflight is batch:
                self._inflight = None
            self.stats.record_batch(batch.jobs)
            queued = bool(self._jobs or self._frees)
            watched = not self._idle  # the worker woke meanwhile and waits for this batch
        if queued or watched:  # else nothing on the event loop waits for it: no wake-up there
            self._to_loop(self._hot_done, batch, queued)
        return sorted(sends, key=lambda s: not _feeds_the_chain(s.msg))

    def _hot_done(self, batch: Batch, queued: bool) -> None:
        """On the event loop: wake whatever waits for the hot step (a worker woken meanwhile, queued work)."""
        batch.answer = (True, None)
        for job in batch.jobs:
            job.done.set()
        batch.arrived.set()
        if queued:
            self._wake.set()

    def _hot_continues(self, batch: Batch, call: Any) -> None:
        """On the event loop: a hot step stopped at a MoE block's remote experts; the worker sees it through."""
        batch.answer = (False, call)
        batch.arrived.set()
        self._wake.set()

    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._token is not None:
            try:
                self._token.run_sync_soon(run_safely, fn, *args)
            except trio.RunFinishedError:
                pass

    def _poke(self) -> None:
        """Wake the worker, from any thread."""
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
        else:
            self._to_loop(self._poke)

    # --- KV slots ----------------------------------------------------------------------------------------

    async def _wait_for_slot(self, book: StageBook, request_id: str, head: str) -> bool:
        """Wait in line for a KV slot; True once one is held for the request (False: it left the line)."""
        book.wait(request_id, head)
        waiter = self._waiters[request_id] = trio.Event()
        try:
            await waiter.wait()
        finally:
            if self._waiters.get(request_id) is waiter:  # cancelled while waiting: the daemon stops
                del self._waiters[request_id]
                book.cancel(request_id)
        return self.book is book and request_id in book.reserved

    def _admit_in_line(self) -> None:
        """On the event loop: give freed slots to the requests waiting here, in order; wake those that left the
        line too."""
        with self._lock:
            book = self.book
            if book is not None:
                book.release_line()
            woken = [r for r in self._waiters if book is None or r not in book.in_line]
        for rid in woken:
            self._waiters.pop(rid).set()

    def slot_state(self) -> tuple[int, int, int] | None:
        """(KV slots, requests holding or waiting for one, version) of the loaded stage, for its heartbeat."""
        loaded = self._current()
        if loaded is None:
            return None
        book = self.book
        if book is None or self._model is not loaded.model:
            return int(loaded.model.max_requests), 0, 0
        return book.slots, book.used + len(book.in_line), book.version

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
        with self._lock:
            dropped = self.book.drop_heads(gone)
            for rid in dropped:
                log.info("request %s: its head is gone; freed its KV cache", rid)
                self._free(self._model, rid)
            self._admit_in_line()
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
                self._drop_queued()
                log.info("stage %d of %d now (blocks %d-%d); requests of the old stage dropped", loaded.hop,
                         loaded.registry.n_stages, loaded.model.start, loaded.model.end - 1)
            version = self.book.version + 1 if self.book is not None else 0  # a head sees the change
            self.book = StageBook(loaded.hop, loaded.registry.n_stages, min(self.max_context, loaded.model.max_context),
                                  loaded.model.vocab_size, self.wire_dtype, slots=loaded.model.max_requests,
                                  version=version, since_epoch=loaded.registry.epoch)
            self._book_key = key
            self._admit_in_line()  # those waiting for the old stage's slots leave the line
            self._model = loaded.model
            self._decode_s.clear()  # a new model's batch sizes are all unseen
            self._ran_hot = None
            self.next_step.expect(None)  # (nor is the old stage's next step expected, nor its model kept)
        assert self.book is not None
        return loaded, self.book

    # --- the worker ------------------------------------------------------------------------------------

    async def _run(self, loaded: Loaded, book: StageBook, work: Work, received: float) -> HandlerResult:
        job = Job(work, loaded.model, loaded, book, received)
        with self._lock:
            if not self._jobs:
                self._first_queued = trio.current_time()
            self._jobs.append(job)
            batch = self._take_batch_now() if self._idle and self._inflight is None and not self._must_wait() else None
        if batch is not None:
            # The batch starts now, not after the worker's wake-up; the worker is woken when the batch's first
            # segment is done (`_segment_done`), so no task runs beside the compute thread's start. A short
            # decode step may run right here instead (`_inlines`): then nothing yields between its end and the
            # output's write to the next stage, which goes before the reader's ack of this frame.
            self._start(batch)
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
            with self._lock:
                for j in job.group or [job]:
                    if j.sends is None and j.done.is_set():  # (not a prefill still running its next chunk)
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

    def _outputs(self, job: Job, written: float = 0.0) -> HandlerResult:
        """What a finished job sends: the next stage's input or the sampled token, or its error to the head
        (`written`: when the first was written ahead of it, its step's sent time)."""
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
        if job.booked:
            outs = book.outputs(work, job.output, next_peer=registry.next_peer(book.hop),
                                first_peer=registry.stage_peer(0))
        else:
            outs = book.complete(work, job.output, next_peer=registry.next_peer(book.hop),
                                 first_peer=registry.stage_peer(0), now=self._now())
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
        sent = written or time.perf_counter()
        self.stats.record_step(job, sent)
        if self.recorder is not None and self.recorder.wants(work.request_id):
            record_stage_step(self.recorder, job, sent, book.hop)
        return [Send(o.peer, o.msg) for o in outs]

    def _free(self, model: Any, request_id: str) -> None:
        if model is not None:
            self._frees.append((model, request_id))
            self._poke()
        # the book let the slot go: the next in line takes it (freed before it runs)
        if threading.get_ident() == self._loop_thread:
            self._admit_in_line()
        else:
            self._to_loop(self._admit_in_line)

    def _drop_queued(self) -> None:
        """With `_lock` held, the book just cleared (every queued step is its): the steps do not run, their
        handlers send nothing. The next batch frees the requests' KV caches first, so a step run after that
        would take a slot nobody frees."""
        for job in self._jobs:
            job.done.set()
        self._jobs = []

    def _take_batch(self) -> list[Job]:
        """Every queued job of one model, one per request (a request's next step waits for the next batch).

        While the stage holds other requests, whose next steps a prefill would hold up, the batch runs at most
        one prefill chunk (`prefill_chunk` rows, one call of the model's prefill graph, whatever the rows); the
        rest of that prompt, and other prompts, run in the batches after it, each with the decode steps queued
        by then."""
        model = self._jobs[0].model
        prefilling = {j.work.request_id for j in self._jobs if j.rows_left > 1}
        chunk = getattr(model, "prefill_chunk", 0)
        book = self.book
        budget = 1 if chunk and book is not None and len(book.requests) > len(prefilling) else None  # chunks
        batch: list[Job] = []
        rest: list[Job] = []
        seen: set[str] = set()
        for job in self._jobs:
            if job.model is not model or job.work.request_id in seen:
                rest.append(job)
                continue
            job.take = job.rows_left
            if job.rows_left > 1 and budget is not None:
                if budget <= 0:
                    rest.append(job)
                    continue
                job.take = min(job.rows_left, chunk)
                budget -= 1
            seen.add(job.work.request_id)
            batch.append(job)
        self._jobs = rest
        return batch

    def _settle(self, batch: Batch) -> None:
        """The batch is over: wake the handlers of its finished (or failed) jobs; a prefill with rows left goes
        back to the front of the queue for its next chunk. Once per batch."""
        with self._lock:
            if batch.settled:
                return
            batch.settled = True
            again = [j for j in batch.jobs if j.output is None and j.error is None and 0 < j.offset < j.work.rows]
            if again:
                self.stats.prefill_chunks_deferred += len(again)
                self._jobs[:0] = again
        for job in batch.jobs:
            if job not in again:
                job.done.set()
        if again:
            self._wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._loop_thread = threading.get_ident()
        self._now = trio.lowlevel.current_clock().current_time
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire_idle)
            task_status.started(self)
            while True:
                with self._lock:
                    self._idle = True
                try:
                    await self._wake.wait()
                except trio.Cancelled:  # the daemon stops: a batch a handler launched must not hold its handlers
                    if self._inflight is not None:
                        for job in self._inflight.jobs:
                            job.done.set()
                    raise
                with self._lock:
                    self._idle = False
                self._wake = trio.Event()
                while self._jobs or self._frees or self._inflight is not None:
                    if self._inflight is None:
                        await self._gather()
                        with self._lock:
                            launched = self._take_batch_now() if self._inflight is None else None
                        if launched is not None:
                            self._start(launched)
                    batch = self._inflight
                    if batch is None:
                        continue
                    try:  # cancelled only when the daemon stops: then it does not wait for a long prefill
                        await self._see_through(batch)
                    except Exception as e:  # a bug in the model code: these requests fail, the daemon goes on
                        log.exception("stage batch of %d failed", len(batch.jobs))
                        for job in batch.jobs:
                            if job.output is None and job.error is None:
                                job.error = ("internal", f"the stage failed: {type(e).__name__}: {e}")
                    except BaseException:  # cancelled: the daemon stops; no job waits for a next chunk
                        for job in batch.jobs:
                            job.done.set()
                        raise
                    finally:
                        with self._lock:
                            if self._inflight is batch:
                                self._inflight = None
                            self._measure(batch)
                        self._settle(batch)
                    if batch.jobs and not (batch.hot and all(j.reply is None for j in batch.jobs)):
                        self.stats.record_batch(batch.jobs)  # (a hot step done on the lane recorded itself)
                    self._answer_hot_replies(batch)

    def _measure(self, batch: Batch) -> None:
        """With `_lock` held: a decode batch's time, for `_inlines` and `take_hot` (a MoE stage's includes the
        wait for its experts: it is never done in one segment)."""
        jobs = batch.jobs
        if (jobs and jobs[0].ended and jobs[0].model is self._model and all(_decodes(j.work) for j in jobs)
                and all(j.error is None for j in jobs)):
            self._decode_s[_rows(jobs)] = jobs[0].ended - jobs[0].started

    def _answer_hot_replies(self, batch: Batch) -> None:
        """A hot step the worker finished (its MoE experts asked by the router): its outputs go out, the lane
        acks its frame."""
        for job in batch.jobs:
            if job.reply is not None:
                reply, job.reply = job.reply, None
                with self._lock:
                    job.sends = as_sends(self._outputs(job))
                reply.done(sorted(job.sends, key=lambda s: not _feeds_the_chain(s.msg)))

    def _launch(self) -> None:
        """Take the next batch (and the KV caches to free) and start it."""
        with self._lock:
            batch = self._take_batch_now()
        self._start(batch)

    def _take_batch_now(self) -> Batch:
        """With `_lock` held: take the next batch (and the KV caches to free) as the one in flight."""
        frees, self._frees = self._frees, []
        jobs = self._take_batch() if self._jobs else []
        taken = time.perf_counter()
        for job in jobs:
            job.taken, job.group = taken, jobs
        batch = self._inflight = Batch(jobs, run_batch(jobs, frees))
        return batch

    def _start(self, batch: Batch) -> None:
        """Start a batch just taken: on the event loop's thread when short (`_inlines`), else on the compute
        thread."""
        jobs = batch.jobs
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
                or not all(_decodes(j.work) for j in jobs)):
            return False
        took = self._decode_s.get(_rows(jobs)) if jobs[0].model is self._model else None
        return took is not None and took <= self.inline_step_s

    def _segment_done(self, batch: Batch, answer: tuple[bool, Any] | None, error: BaseException | None) -> None:
        jobs = batch.jobs
        self._count_local_answers(batch)
        with self._lock:
            if (jobs and answer is not None and answer[0] and jobs[0].ended and jobs[0].model is self._model
                    and all(_decodes(j.work) for j in jobs)):
                self._decode_s[_rows(jobs)] = jobs[0].ended - jobs[0].started
            self._first_segment_done(batch, answer, error)
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
        if batch.resume is not None:  # a hot step whose experts answered while tinygrad was busy elsewhere
            (answer, failed), batch.resume = batch.resume, None
            done, call = await self.compute.run(advance_here, batch.steps, None if failed else answer, failed,
                                                self.local_experts)
            self._count_local_answers(batch)
        rec = self.recorder
        traced = {j.work.request_id: j.work.step for j in batch.jobs if rec is not None and rec.wants(j.work.request_id)}
        while not done:
            answer: np.ndarray | None = None
            error: Exception | None = None
            if self.experts is None:
                error = ExpertsFailed("this stage's experts live elsewhere and the daemon has no MoE router")
            else:
                with trio.CancelScope() as batch.asking:
                    with self._lock:
                        if self._all_cancelled(batch):
                            batch.asking.cancel()
                    try:
                        answer = await self.experts(call, traced) if traced else await self.experts(call)
                    except Exception as e:  # the step fails for these requests (see run_batch), the daemon goes on
                        error = ExpertsFailed(f"{type(e).__name__}: {e}")
                if batch.asking.cancelled_caught:
                    error = ExpertsFailed("every request of the step was cancelled")
                batch.asking = None
            done, call = await self.compute.run(advance_here, batch.steps, answer, error, self.local_experts)
            self._count_local_answers(batch)

    def _first_segment_done(self, batch: Batch, answer: tuple[bool, Any] | None, error: BaseException | None) -> None:
        """On the event loop, as the compute thread finishes a batch's first segment: a finished batch wakes its
        handlers at once. Must not raise."""
        batch.error = error
        if error is None and answer is not None:
            batch.answer = answer
            if answer[0]:
                self._settle(batch)
        batch.arrived.set()

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
        if book is None or not self._jobs or not all(_decodes(j.work) for j in self._jobs):
            return False
        with self._lock:
            return any(book.elsewhere(st) for st in book.requests.values())

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
        while self._must_wait() and trio.current_time() < deadline:
            with trio.move_on_at(deadline):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _expire_idle(self) -> None:
        while True:
            await trio.sleep(max(1.0, self.idle_timeout / 4))
            if self.book is not None:
                with self._lock:
                    for rid in self.book.expire(trio.current_time(), self.idle_timeout):
                        log.info("request %s idle for %.0f s: freed its KV cache", rid, self.idle_timeout)
                        self._free(self._model, rid)


def _decode_shaped(msg: Any) -> bool:
    """Whether `msg` is a plain decode step (one row, no sampling settings, targets or resume): what a stage
    may run on a lane's reader."""
    if isinstance(msg, Token):
        return msg.hop == 0
    return (isinstance(msg, Forward) and msg.rows == 1 and msg.step > 0 and msg.sampling is None
            and msg.targets is None and not msg.all_logits and not msg.resume_of and msg.draft is None
            and not msg.chain)


def _decodes(work: Work) -> bool:
    """Whether `work` runs in the decode batch: one position, or a verify step's positions one per row."""
    return work.rows == 1 or work.verify


def _rows(jobs: Sequence[Job]) -> int:
    return sum(j.work.rows for j in jobs)


def _feeds_the_chain(msg: Any) -> bool:
    """Whether `msg` is a stage's input (a `Forward`, or stage 0's copy of a token), not the head's."""
    return isinstance(msg, Forward) or (isinstance(msg, Token) and msg.hop == 0)


def _refusal(head: str, request_id: str, step: int, hop: int, e: StageRefusal) -> Send:
    log.info("refused step %d of %s: %s: %s", step, request_id, e.code, e)
    return Send(head, Error(e.code, str(e), request_id=request_id, step=step, hop=hop))
