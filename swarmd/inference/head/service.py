"""The head actor: the daemon that accepted a request sends it into the chain and streams what comes back.

    async with head.open(HeadRequest(prompt_ids, max_tokens=64), on_wait=print) as request:
        async for event in request:          # TokenOut, PromptScores, then Finished or Failed
            ...

`open` waits its turn in the daemon's queue (`swarmd.inference.head.admission`: bounded, fair across clients)
until every stage of the plan is alive and loaded (up to `ready_timeout`) and has a KV slot free, telling
`on_wait` what it waits for; sends the prompt's token ids to stage 0 as a `Forward` carrying the sampling settings
(seeded per request); and hands the `Token`s the last stage sends back to a `HeadSession`
(`swarmd.inference.head.session`), whose events the caller iterates. Leaving the block, however it is left (finished,
a stop string, the client went away, an error), sends `Cancel` to every stage so that each frees the
request's KV cache, and gives its place up. The HTTP routes take the place first (`admit`, which answers 429
when the queue is full) and wait for the turn (`wait_turn`) before their response starts.

A stage that finds no slot free holds a new request until one frees; when too many wait there it answers
`busy`, and the request goes back to the front of the queue and is sent again, as a new attempt, when the
chain has room.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from models.sampling import SamplingParams
from swarmd.config import Timings
from swarmd.inference.head.admission import Admission, Closed, NotReady, QueueFull, Turn
from swarmd.inference.head.hop_local import plan_move
from swarmd.inference.head.recovery import (
    CHAIN_ERRORS,
    MAX_MOVES,
    Recovery,
    attempt_id,
    chain_changed,
    replay_forward,
)
from swarmd.inference.head.session import Event, Failed, HeadSession, TokenOut
from swarmd.inference.head.slots import StageSlots
from swarmd.inference.registry import ChainStatus, Registry
from swarmd.inference.spec.head import DraftRefused, SpecError, SpecHead
from swarmd.inference.spec.speculation import Speculation
from swarmd.net.identity import short_id
from swarmd.observe.spans import SpanRecorder
from swarmd.observe.trace_collect import TraceCollector
from swarmd.spec_settings import SpecRequest, SpecSettings
from swarmd.tasks import spawn
from swarmd.transport.transport import ActorTransport, DeliveryFailed, HandlerResult, Refused
from swarmd.wire.codec import WireTensor
from swarmd.wire.messages import Cancel, Error, Forward, Logprobs, Sampling, Token, Verified

log = logging.getLogger(__name__)

MAX_SEED = (1 << 63) - 1
OnWait = Callable[[str], Awaitable[None]]  # told what the request waits for, each time that changes
MOVE_CHECK_INTERVAL = 0.1  # s between looks at the plan for requests whose chain changed
TOO_SMALL_GRACE = 5.0  # s a moving request waits once the leader says the model no longer fits the swarm
MAX_BUSY_RETRIES = 64  # a request the chain's stages turned away as busy this often fails (something is wrong)
BUSY_CODES = frozenset({"busy", "kv_cache_full"})  # a stage had no KV slot: the request waits its turn again

# The HTTP status of a failure code, where it is not a plain bad request (400). 503: the swarm cannot serve;
# 429: it is busy (the client may retry after a while).
STATUS = {"leaving": 503, "swarm_too_small": 503, "not_ready": 503, "unreachable": 503, "timeout": 504, "internal": 500,
          "model_error": 500, "unknown_request": 502, "out_of_order": 502, "not_a_stage": 503, "wrong_hop": 503,
          "stale_plan": 503, "queue_full": 429, "busy": 429, "kv_cache_full": 429}


def status_of(code: str) -> int:
    return STATUS.get(code, 400 if code in CLIENT_CODES else 502)


CLIENT_CODES = {"empty_prompt", "context_length_exceeded", "context_full", "bad_token", "bad_max_tokens",
                "bad_logprobs", "bad_seed", "bad_speculate"}


class HeadError(Exception):
    """A request that cannot be served; `status` is the HTTP status the API answers with."""

    def __init__(self, code: str, message: str, status: int = 400, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status
        self.retry_after = retry_after  # s, for a busy swarm (429)


@dataclass(frozen=True)
class HeadRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: a random seed for this request
    stop: tuple[str, ...] = ()
    logprobs: int = 0  # top alternatives per token; > 0 also returns each token's own log-prob
    prompt_scores: bool = False  # teacher forcing: log-probs of every prompt token too (echo)
    trace: bool = False
    speculate: SpecRequest | None = None  # None: the daemon's default (`swarmd join --speculate`)


@dataclass
class Timing:
    """Wall-clock points of one request (time.perf_counter seconds)."""

    opened: float = 0.0
    sent: float = 0.0  # the prompt went to stage 0 (after waiting for the chain)
    first: float = 0.0  # the first token came back
    last: float = 0.0  # the latest token came back
    tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        decode_s = self.last - self.first if self.tokens > 1 else 0.0
        return {
            "wait_s": round(self.sent - self.opened, 6) if self.sent else None,
            "time_to_first_token_s": round(self.first - self.sent, 6) if self.first else None,
            "decode_s": round(decode_s, 6),
            "decode_tokens_per_s": round((self.tokens - 1) / decode_s, 3) if decode_s > 0 else None,
            "total_s": round((self.last or time.perf_counter()) - self.opened, 6),
        }


@dataclass
class ModelInfo:
    name: str
    tokenizer: Any  # models.text.tokenizer.Tokenizer
    max_context: int
    vocab_size: int


@dataclass
class RequestHandle:
    """One request in flight; iterate it for its events."""

    request_id: str
    session: HeadSession
    seed: int
    timings: Timings
    registry: Registry = field(default_factory=lambda: Registry(0, (), (), {}))
    timing: Timing = field(default_factory=Timing)
    recorder: SpanRecorder | None = None  # set while the request is traced
    on_first: Callable[[float], None] | None = None  # told the time to the first token (s)
    request: HeadRequest | None = None
    sampling: Sampling | None = None
    spec: Speculation | None = None  # a speculative request: the head drafts every step after the prompt
    attempt: int = 0  # how often the request was sent anew (its stages know it as `wire_id`)
    moves: int = 0  # of those, how often it moved to a new chain (the others: a stage was busy)
    busy_retries: int = 0
    turn: Turn | None = None  # its place in the head's queue
    moving: bool = False
    deferred_error: Error | None = None  # a stage's error that came while the request was moving
    full_replay: bool = False  # a stage could not continue an attempt: the next move replays on every stage
    closed: bool = False  # the caller left the block: nothing more is sent for it
    recoveries: list[Recovery] = field(default_factory=list)
    _send: trio.MemorySendChannel[Event] | None = None
    _recv: trio.MemoryReceiveChannel[Event] | None = None
    _over: bool = False

    def __post_init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[Event](math.inf)  # bounded by the request's tokens

    @property
    def prompt_tokens(self) -> int:
        return self.session.prompt_len

    @property
    def wire_id(self) -> str:
        return attempt_id(self.request_id, self.attempt)

    def push(self, events: list[Event]) -> None:
        now = time.perf_counter()
        for ev in events:
            if isinstance(ev, TokenOut):
                if not self.timing.first and self.on_first is not None:
                    self.on_first(now - self.timing.sent)
                self.timing.first = self.timing.first or now
                self.timing.last = now
                self.timing.tokens += 1
                if self.recoveries and not self.recoveries[-1].first_token:
                    self.recoveries[-1].first_token = now
                if self.recorder is not None:
                    self.recorder.add(self.request_id, "token", "head", now, now, instant=True, step=ev.step,
                                      token=ev.token_id)
            assert self._send is not None
            self._send.send_nowait(ev)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Event:
        """The next event; a Failed("timeout") when the swarm says nothing for too long; then the end."""
        assert self._recv is not None
        if self._over:
            raise StopAsyncIteration
        wait = self.timings.token_timeout if self.timing.first else self.timings.first_token_timeout
        with trio.move_on_after(wait) as timer:
            event = await self._recv.receive()
        if timer.cancelled_caught:
            what = "the next token" if self.timing.first else "the first token"
            failed = self.session.fail("timeout", f"no answer from the swarm for {wait:.0f} s waiting for {what} "
                                                  f"({self.whereabouts()})")
            event = failed[0] if failed else Failed("timeout", "no answer from the swarm")
        if isinstance(event, Failed) or (self.session.done and self._recv.statistics().current_buffer_used == 0):
            self._over = True
        return event

    def whereabouts(self) -> str:
        """Where the request was last sent, and its move under way if any (for errors a user can act on)."""
        chain = " -> ".join(short_id(p) for p in self.registry.stages) or "no chain"
        said = f"attempt {self.attempt} on plan epoch {self.registry.epoch}: {chain}"
        if self.moving and self.recoveries:
            move = self.recoveries[-1]
            said += f"; moving for {time.perf_counter() - move.noticed:.0f} s ({move.reason})"
            if move.waiting and not move.ready:
                said += f", waiting: {move.waiting}"
        elif self.recoveries:  # it moved, and the new chain said nothing since: why it moved is likely why
            said += f"; moved after: {self.recoveries[-1].reason}"
        return said

    def record(self, name: str, start: float, end: float, **args: Any) -> None:
        """A span of this request on the head (perf_counter seconds), if it is traced."""
        if self.recorder is not None:
            self.recorder.add(self.request_id, name, "head", start, end, **args)

    def record_phases(self) -> None:
        """The head's view of the whole request: prefill (to the first token) and decode."""
        t = self.timing
        if t.first:
            self.record("head.prefill", t.sent, t.first, prompt_tokens=self.prompt_tokens)
        if t.tokens > 1:
            self.record("head.decode", t.first, t.last, tokens=t.tokens - 1)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.session.prompt_len, "completion_tokens": self.session.completion_tokens,
                "total_tokens": self.session.prompt_len + self.session.completion_tokens}


class HeadService:
    """The requests this daemon heads. Route `Token` (hop 1), `Logprobs` and `Error` messages to it."""

    def __init__(self, peer_id: str, transport: ActorTransport, *, chain: Callable[[], ChainStatus],
                 registry: Callable[[], Registry], timings: Timings, load_model: Callable[[], ModelInfo],
                 in_flight: Callable[[int], None] = lambda delta: None,
                 leaving: Callable[[], bool] = lambda: False, hop_local: bool = True,
                 capacity: Callable[[], Mapping[str, StageSlots | None]] = dict, max_queued: int = 256,
                 blocking: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync,
                 speculation: SpecHead | None = None) -> None:
        self.peer_id = peer_id
        self.speculation = speculation or SpecHead(peer_id, SpecSettings())
        self._blocking = blocking  # loads the tokenizer off the event loop (a worker thread; inline in simulations)
        self.hop_local = hop_local  # moves keep the KV caches of the stages that stay (False: full replays)
        self.transport = transport
        self._chain = chain
        self._registry = registry
        self.timings = timings
        self._load_model = load_model
        self._leaving = leaving
        # the queue of requests waiting for a slot on every stage (counted in flight from arrival to end)
        self.admission = Admission(chain=chain, registry=registry, capacity=capacity, timings=timings,
                                   max_queued=max_queued, in_flight=in_flight)
        self._model: ModelInfo | None = None
        self._model_lock = trio.Lock()
        self.requests: dict[str, RequestHandle] = {}
        self._nursery: trio.Nursery | None = None
        self.stats = {"requests": 0, "finished": 0, "failed": 0, "cancelled": 0, "tokens": 0, "moved": 0, "busy": 0}
        self.tracing: TraceCollector | None = None  # gathers traced requests' spans (swarmd.observe.trace_collect)
        self.on_first_token: Callable[[float], None] | None = None  # metrics: time to first token (s)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.admission.run)
            task_status.started(self)
            await self._follow_plans()

    async def model(self) -> ModelInfo:
        """The served model's tokenizer and limits (read from its GGUF once, in a worker thread)."""
        async with self._model_lock:
            if self._model is None:
                self._model = await self._blocking(self._load_model)
            return self._model

    # --- waiting for the chain ---------------------------------------------------------------------------

    async def wait_ready(self, within: float | None = None, on_wait: OnWait | None = None, *,
                         give_up_when_too_small: bool = False) -> Registry:
        """The registry of a plan whose stages are all ready; HeadError (503) if none is within `within` s,
        or (`give_up_when_too_small`) once the swarm has been unable to hold the model for a few seconds."""
        timeout = self.timings.ready_timeout if within is None else within
        deadline = trio.current_time() + timeout
        said = ""
        too_small_since: float | None = None
        while True:
            status = self._chain()
            if status.ready:
                return self._registry()
            if not status.cannot_hold:
                too_small_since = None
            elif too_small_since is None:
                too_small_since = trio.current_time()
            elif give_up_when_too_small and trio.current_time() - too_small_since >= TOO_SMALL_GRACE:
                raise HeadError("swarm_too_small", f"the swarm can no longer hold the model: {status.detail}", 503)
            if on_wait is not None and status.detail != said:
                await on_wait(status.detail)
            said = status.detail
            if trio.current_time() >= deadline:
                raise HeadError("not_ready", f"the swarm is not ready after {timeout:.0f} s: {status.detail}", 503)
            await trio.sleep(0.2)

    # --- requests ------------------------------------------------------------------------------------------

    def admit(self, client: str) -> Turn:
        """A place in this daemon's queue for a request of `client`; HeadError 429 (with retry_after) when the
        queue is full, 503 while the daemon leaves. Close it (`close_turn`) however the request ends."""
        if self._leaving():
            raise HeadError("leaving", "this daemon is leaving the swarm: send the request to another member", 503)
        try:
            return self.admission.admit(client)
        except QueueFull as e:
            raise HeadError("queue_full", e.message, 429, retry_after=e.retry_after) from None

    async def wait_turn(self, turn: Turn, on_wait: OnWait | None = None, *, within: float | None = None,
                        give_up_when_too_small: bool = False) -> Registry:
        """Wait in the queue until the request may start; the chain to send it to. HeadError 503 when the
        swarm cannot serve (not ready within `within` s), 429 when the request was pushed out of the queue."""
        try:
            return await self.admission.wait_turn(turn, on_wait, within=within,
                                                  give_up_when_too_small=give_up_when_too_small)
        except NotReady as e:
            raise HeadError(e.code, e.message, 503) from None
        except QueueFull as e:
            raise HeadError("queue_full", e.message, 429, retry_after=e.retry_after) from None
        except Closed:
            raise HeadError("cancelled", "the request was cancelled while it waited", 499) from None

    def close_turn(self, turn: Turn) -> None:
        self.admission.close(turn)

    @asynccontextmanager
    async def open(self, req: HeadRequest, *, turn: Turn | None = None, on_wait: OnWait | None = None,
                   ready_timeout: float | None = None) -> AsyncIterator[RequestHandle]:
        """The request, sent into the chain once it is its turn (`turn`: its place, taken with `admit`; by
        default one is taken here). Its place is given up when the block is left."""
        turn = turn if turn is not None else self.admit("local")
        try:
            model = await self.model()
            check_request(req, model)
            speculate = await self.check_speculation(req, model)
        except BaseException:
            self.close_turn(turn)
            raise
        recorder = self.tracing.recorder if req.trace and self.tracing is not None else None
        request_id = f"req-{random.getrandbits(64):016x}"  # the process RNG: a simulation seed replays it
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        session = HeadSession(request_id, len(req.prompt_ids), req.max_tokens, model.tokenizer.stream_decoder(),
                              req.stop, want_prompt_scores=req.prompt_scores)
        handle = RequestHandle(request_id, session, seed, self.timings, recorder=recorder,
                               on_first=self.on_first_token, request=req, turn=turn)
        if recorder is not None:
            recorder.trace(request_id)
        handle.timing.opened = turn.arrived
        if speculate.on and not req.prompt_scores:
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=seed)
            try:
                drafter = await self.speculation.drafter(speculate, request_id, req.prompt_ids, params, seed,
                                                         model.tokenizer.tokens, model.max_context)
            except BaseException:
                self.close_turn(turn)
                raise
            handle.spec = self.speculation.start(speculate, drafter, prompt_len=len(req.prompt_ids),
                                                 max_tokens=max(req.max_tokens, 1), max_context=model.max_context)
        self.stats["requests"] += 1
        sent, crashed = False, False
        try:
            handle.registry = await self.wait_turn(turn, on_wait, within=ready_timeout)
            handle.record("head.wait_for_chain", handle.timing.opened, time.perf_counter())
            self.requests[request_id] = handle
            sent = True  # from here on the stages may hold the request, even if sending seems to fail
            await self._send_prompt(handle, req, model)
            yield handle
        except HeadError:
            crashed = True
            raise
        finally:
            handle.closed = True
            if handle.spec is not None:
                self.speculation.close(handle.spec)
            for attempt in range(handle.attempt + 1):
                self.requests.pop(attempt_id(request_id, attempt), None)
            self.close_turn(turn)
            if session.done and session.error is None:
                outcome = "finished"
            else:
                outcome = "failed" if session.error is not None or crashed else "cancelled"
            self.stats[outcome] += 1
            self.stats["tokens"] += session.completion_tokens
            if sent:
                self._spawn(self._cancel_chain, handle.wire_id, handle.registry, outcome)

    async def _send_prompt(self, handle: RequestHandle, req: HeadRequest, model: ModelInfo) -> None:
        ids = np.asarray(req.prompt_ids, dtype=np.int32)
        sampling = Sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=handle.seed,
                            logprobs=req.logprobs, max_tokens=max(req.max_tokens, 1),
                            stop_ids=tuple(sorted(model.tokenizer.stop_ids)), trace=handle.recorder is not None,
                            speculative=handle.spec is not None)
        handle.sampling = sampling
        targets = WireTensor.from_array(ids[1:]) if req.prompt_scores else None
        msg = Forward(handle.request_id, 0, 0, 0, self.peer_id, tokens=WireTensor.from_array(ids),
                      epoch=handle.registry.epoch, all_logits=req.prompt_scores, sampling=sampling, targets=targets)
        stage0 = handle.registry.stage_peer(0)
        handle.timing.sent = time.perf_counter()
        try:
            await self.transport.send(stage0, msg)
        except Refused as e:
            raise HeadError(e.error.code, f"stage 0 refused the request: {e.error.message}", 502) from None
        except DeliveryFailed as e:
            # stage 0 died between the plan and this send: the request moves to the next chain, as one
            # already running would (the move has its own deadline and gives the client a clear error)
            reason = f"stage 0 ({stage0[-6:]}) did not take the request: {e.reason}"
            if not self._start_move(handle, reason):
                raise HeadError("unreachable", reason, 503) from None

    async def _cancel_chain(self, request_id: str, registry: Registry, reason: str) -> None:
        """Tell every stage the request is over, so that each frees its KV cache (best effort, bounded)."""
        await self._cancel_on(request_id, tuple(enumerate(registry.stages)), reason)

    async def _cancel_on(self, request_id: str, hops: tuple[tuple[int, str], ...], reason: str) -> None:
        """`_cancel_chain` on the (hop, peer) pairs given."""

        async def tell(hop: int, peer: str) -> None:
            try:
                await self.transport.send(peer, Cancel(request_id, reason, hop=hop), within=self.timings.cancel_timeout)
            except (Refused, DeliveryFailed) as e:
                log.info("could not tell stage %d that %s is over: %s", hop, request_id, e)

        async with trio.open_nursery() as nursery:
            for hop, peer in hops:
                nursery.start_soon(tell, hop, peer)

    def _spawn(self, fn: Any, *args: Any) -> bool:
        """Start `fn` in the head's nursery; False once the daemon is stopping (the stages forget on their own)."""
        return spawn(self._nursery, fn, *args)

    # --- moving requests to a new chain ---------------------------------------------------------------------

    async def _follow_plans(self) -> None:
        """Move every request whose chain a new plan changed (a stage died or left, blocks moved), or one of
        whose stages membership marks dead (the move waits for the plan that replaces it)."""
        while True:
            await trio.sleep(MOVE_CHECK_INTERVAL)
            if not self.requests:
                continue  # nothing to move: the chain's status (a status snapshot) is not worth making
            now, status = self._registry(), self._chain()
            for handle in self.handles():
                if handle.moving or handle.session.ended:
                    continue
                if chain_changed(handle.registry, now):
                    self._start_move(handle, f"plan epoch {now.epoch} changed the chain")
                elif status.gone & set(handle.registry.stages):
                    self._start_move(handle, status.detail)

    def handles(self) -> list[RequestHandle]:
        """The requests this daemon heads, each once (a moved request is known under each attempt's id)."""
        return list({id(h): h for h in self.requests.values()}.values())

    def _start_move(self, handle: RequestHandle, reason: str) -> bool:
        """Start moving `handle` to the current chain; False if it cannot move (closed, or no task to move it)."""
        if self._nursery is None or handle.closed:
            return False
        if not handle.moving:
            handle.moving = self._spawn(self._move, handle, reason)
            return handle.moving
        return True

    async def _move(self, handle: RequestHandle, reason: str) -> None:
        """Replay the request's tokens through the current chain as a new attempt (see `swarmd.inference.head.recovery`)."""
        log.info("moving %s: %s", handle.request_id, reason)
        recovery = Recovery(reason, time.perf_counter())
        handle.recoveries.append(recovery)
        self.stats["moved"] += 1
        assert self._nursery is not None and handle.request is not None and handle.sampling is not None
        try:
            while True:
                if handle.moves >= MAX_MOVES:
                    self._spawn(self._cancel_chain, handle.wire_id, handle.registry, "moved")
                    raise HeadError("unreachable", f"moved {MAX_MOVES} times and the chain still does not hold it "
                                                   f"(last: {reason})", 503)
                registry = await self.wait_ready(give_up_when_too_small=True, on_wait=recovery.wait_says)
                if handle.session.ended or handle.closed:
                    return  # leaving `open` cancels the attempt on its chain
                req, session = handle.request, handle.session
                owes_scores = req.prompt_scores and not session.scored
                move = plan_move(handle.registry, registry,
                                 allowed=self.hop_local and not handle.full_replay and not owes_scores)
                # the stages that stay keep the old attempt (the replay names it); the others forget it
                self._spawn(self._cancel_on, handle.wire_id, move.cancel, "moved")
                resume_of = handle.wire_id if move.hop_local else ""
                recovery.ready, recovery.epoch = time.perf_counter(), registry.epoch
                recovery.kept_hops = tuple(hop for hop, _ in move.kept)
                handle.attempt += 1
                handle.moves += 1
                handle.registry = registry
                if handle.turn is not None:
                    self.admission.moved(handle.turn, registry)
                self.requests[handle.wire_id] = handle
                msg = replay_forward(handle.request_id, handle.attempt, self.peer_id, req.prompt_ids,
                                     list(session.tokens), handle.sampling, registry.epoch,
                                     prompt_scores=owes_scores, resume_of=resume_of)
                recovery.sent, recovery.replayed_tokens = time.perf_counter(), msg.rows
                try:
                    await self.transport.send(registry.stage_peer(0), msg)
                except (Refused, DeliveryFailed) as e:
                    log.info("moving %s: stage 0 did not take the replay: %s", handle.request_id, e)
                    if move.hop_local:  # which attempt the stages hold is unclear now: start again from nothing
                        handle.full_replay = True
                        self._spawn(self._cancel_on, resume_of, move.kept, "moved")
                    await trio.sleep(MOVE_CHECK_INTERVAL)
                    continue
                if handle.closed:
                    self._spawn(self._cancel_chain, handle.wire_id, registry, "cancelled")
                return
        except HeadError as e:
            handle.push(handle.session.fail(e.code, f"the request's chain broke and it could not move: {e.message}"))
        finally:
            self._moved(handle)

    async def _wait_again(self, handle: RequestHandle, hop: int) -> None:
        """Stage `hop` had no KV slot for the request: the attempt is cancelled on every stage, the request goes
        back to the front of the queue, and its tokens so far are sent again, as a new attempt, on its turn."""
        assert self._nursery is not None and handle.request is not None and handle.sampling is not None
        turn = handle.turn
        try:
            handle.busy_retries += 1
            self.stats["busy"] += 1
            self._spawn(self._cancel_chain, handle.wire_id, handle.registry, "busy")
            if turn is None:
                raise HeadError("busy", "the chain had no KV slot free for the request", 429)
            self.admission.requeue(turn, handle.registry.stages[hop] if hop < handle.registry.n_stages else None)
            while True:
                registry = await self.wait_turn(turn, give_up_when_too_small=True)
                if handle.session.ended or handle.closed:
                    return
                req, session = handle.request, handle.session
                handle.attempt += 1
                handle.registry = registry
                self.requests[handle.wire_id] = handle
                msg = replay_forward(handle.request_id, handle.attempt, self.peer_id, req.prompt_ids,
                                     list(session.tokens), handle.sampling, registry.epoch,
                                     prompt_scores=req.prompt_scores and not session.scored)
                if not handle.timing.first:
                    handle.timing.sent = time.perf_counter()
                try:
                    await self.transport.send(registry.stage_peer(0), msg)
                except (Refused, DeliveryFailed) as e:
                    log.info("%s: stage 0 did not take it again: %s", handle.request_id, e)
                    self.admission.requeue(turn, None)
                    await trio.sleep(MOVE_CHECK_INTERVAL)
                    continue
                if handle.closed:
                    self._spawn(self._cancel_chain, handle.wire_id, registry, "cancelled")
                return
        except HeadError as e:
            handle.push(handle.session.fail(e.code, e.message))
        finally:
            self._moved(handle)

    def _moved(self, handle: RequestHandle) -> None:
        """The move (or the new turn) is over: an error about the new attempt that came while it was under way
        (a stage may refuse a Forward before the send returns) is handled now."""
        handle.moving = False
        error, handle.deferred_error = handle.deferred_error, None
        if error is not None and error.request_id == handle.wire_id and not handle.session.ended:
            self.on_error(error)

    # --- messages from the chain ----------------------------------------------------------------------------

    async def on_token(self, peer: str, msg: Token) -> HandlerResult:
        handle = self.requests.get(msg.request_id)
        if handle is not None:
            start = time.perf_counter()
            before = len(handle.session.tokens)
            events = handle.session.on_token(msg)  # in step order, detokenised, stop strings found
            handle.record("head.detokenize", start, time.perf_counter(), step=msg.step)
            handle.push(events)
            if handle.spec is not None and msg.request_id == handle.wire_id:  # the chain drives a speculative one
                return self.speculation.on_chain_token(handle, msg, handle.session.tokens[before:])
        return None

    async def on_verified(self, peer: str, msg: Verified) -> HandlerResult:
        """A speculative request's step came back: its tokens go to the session, and the next step to stage 0."""
        handle = self.requests.get(msg.request_id)
        if handle is None or handle.spec is None or msg.request_id != handle.wire_id:
            return None  # not headed here, or an earlier attempt's (the request moved: its replay continues it)
        return await self.speculation.on_verified(handle, msg)

    async def check_speculation(self, req: HeadRequest, model: ModelInfo) -> SpecSettings:
        """The speculation `req` runs with; HeadError (400) when it asks for what this daemon cannot do."""
        try:
            settings = self.speculation.settings(req.speculate)
            if settings.draft_model is not None:
                await self.speculation.draft_model(settings.draft_model, model.tokenizer.tokens, model.max_context)
        except (SpecError, DraftRefused) as e:
            raise HeadError("bad_speculate", str(e), 400) from None
        return settings

    async def trace(self, handle: RequestHandle) -> list[dict[str, Any]]:
        """The request's Chrome trace events from every node on its path ([] when it is not traced)."""
        if handle.recorder is None or self.tracing is None:
            return []
        handle.record_phases()
        return await self.tracing.collect(handle.request_id, handle.registry.stages)

    async def on_logprobs(self, peer: str, msg: Logprobs) -> None:
        handle = self.requests.get(msg.request_id)
        if handle is not None:
            handle.push(handle.session.on_logprobs(msg))

    def on_error(self, msg: Error) -> bool:
        """A stage says the request failed; False if this daemon does not head it. An error about an earlier
        attempt is stale; one that says the chain lost the request moves it instead of failing it."""
        handle = self.requests.get(msg.request_id)
        if handle is None:
            return False
        if msg.request_id != handle.wire_id:
            return True  # about an earlier attempt
        if handle.moving:
            handle.deferred_error = msg  # about the attempt being sent now: once the send is done
            return True
        if msg.code in BUSY_CODES and handle.busy_retries < MAX_BUSY_RETRIES and not handle.closed:
            handle.moving = self._spawn(self._wait_again, handle, msg.hop)
            if handle.moving:
                return True
        if msg.code in CHAIN_ERRORS and handle.moves < MAX_MOVES:
            handle.full_replay = handle.full_replay or msg.code == "resume_failed"
            self._start_move(handle, f"stage {msg.hop}: {msg.code}: {msg.message}")
            return True
        handle.push(handle.session.on_error(msg))
        return True


def check_request(req: HeadRequest, model: ModelInfo) -> None:
    """Refuse what no stage could serve, in words a user can act on (HeadError, HTTP 400)."""
    n = len(req.prompt_ids)
    if n == 0:
        raise HeadError("empty_prompt", "the prompt is empty: give some text (or token ids) to continue")
    if n >= model.max_context:
        raise HeadError("context_length_exceeded", f"the prompt is {n} tokens but the context holds "
                                                   f"{model.max_context}: shorten the prompt")
    bad = [i for i in req.prompt_ids if not 0 <= i < model.vocab_size]
    if bad:
        raise HeadError("bad_token", f"token id {bad[0]} is outside the vocabulary of {model.vocab_size}")
    if req.max_tokens < 0 or (req.max_tokens == 0 and not req.prompt_scores):
        raise HeadError("bad_max_tokens", "max_tokens must be at least 1 (0 only with echo and logprobs)")
    if not 0 <= req.logprobs <= 20:
        raise HeadError("bad_logprobs", "logprobs must be between 0 and 20")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise HeadError("bad_seed", f"seed must be between 0 and {MAX_SEED}")
