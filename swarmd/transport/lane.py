"""The hot lane: a token's messages between daemons, read, run and sent on without the event loop.

A hop through the actor transport wakes the event loop on each side: the receiving process's loop reads the
frame, decodes it, admits it, starts a handler task, which hands the step to a thread; the sender's loop
encodes and writes. The lane carries the messages on a token's critical path (`Forward`, `Token`,
`ExpertBatch`, `ExpertResult`) on streams of their own, detached from the event loop
(`swarmd.net.seam.DetachedStream`: a thread per stream on the TLS data plane, a task in the in-memory twin),
in the fixed binary layout (`swarmd.wire.binary`). On the receiving side the stream's reader thread decodes
and checks the frame and gives it to the message's hot handler (`route`) right there: a stage runs a short
decode step and writes its output to the next stage's lane before anything else happens, then acks the frame
it came in on. Trio keeps the control plane: membership, plans, the API, retries, and every message the lane
does not carry or whose handler declines it.

Reliability is the actor transport's, which the lane shares and falls back on:
- the receiver de-duplicates lane frames in the transport's table (`ActorTransport.begin` / `finish`), so a
  message that comes twice, by the lane or by the transport, runs once, and a repeat gets the cached answer;
- a frame that is not acked (the stream broke, or the peer stopped answering pings) is given to the transport
  (`post_all`), which retries it with backoff until its deadline; so does a message when the lane to its
  peer is not open (yet), full, or the peer has none (a libp2p-only path).
- a hot handler may decline (`DECLINE`): a batch of several requests, a prefill, a busy stage. The message
  then takes the transport's path on the event loop (admission, a handler task), already marked new.

A `Shortcut` step whose output down the chain is known once its model ran (`Ahead`) has that frame written
before its messages are built: the message kept for retries and repeats and the observer's count come after
the write.

A handler that cannot finish on the reader (a MoE step waiting for remote experts) returns `LATER` and calls
`reply.done(result)` from whichever thread finishes it; the frame is acked then. The reader gathers the acks of
the frames it ran and writes them together, `ack_delay` after the oldest (a quarter of a second, far below the
sender's `ack_timeout`): no ack is written or read between two steps of a token.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from swarmd.errors import RemoteProtocolError
from swarmd.net.framing import HEADER, FrameDecoder, FrameTooLarge
from swarmd.net.identity import short_id
from swarmd.net.seam import DetachedStream, Network, Stream, StreamClosed, detachable
from swarmd.net.streams import close_quietly
from swarmd.transport.delivery import Health, Liveness, RetryPolicy, Seen
from swarmd.transport.links import HELLO_TIMEOUT, read_hello
from swarmd.transport.transport import ActorTransport, HandlerResult, Posted, Send, as_sends, error_reply
from swarmd.wire.binary import ack_frame, decode_body, encode_frame
from swarmd.wire.codec import WireError
from swarmd.wire.messages import (
    Ack,
    Error,
    ExpertBatch,
    ExpertResult,
    Forward,
    Hello,
    Key,
    Message,
    Ping,
    Pong,
    Token,
    encode,
)

log = logging.getLogger(__name__)

LANE_PROTOCOL = "/swarmd/lane/1.0.0"
LANE_MESSAGES = (Forward, Token, ExpertBatch, ExpertResult)


class _Verdict:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


DECLINE = _Verdict("DECLINE")  # a hot handler's answer: not here; the transport's handler runs it on the event loop
LATER = _Verdict("LATER")  # a hot handler's answer: `reply.done(result)` comes later, from any thread


@dataclass(frozen=True)
class LaneConfig:
    window: int = 64  # frames a destination may have unacked on the lane; beyond, the transport carries them
    ack_timeout: float = 2.0  # unanswered this long: ping; the ping unanswered as long: the stream is dead
    write_wait: float = 10.0  # s a lane thread's write waits for room in the socket
    loop_write_wait: float = 0.05  # ... and a write from the event loop's thread (which must not stall)
    no_lane_retry: float = 30.0  # s before asking again for a lane to a peer whose path cannot carry one
    ack_delay: float = 0.25  # s a receiver gathers acks before writing them (far below ack_timeout): a frame a token
    ack_batch: int = 16  # ... or until this many wait
    idle_timeout: float = 300.0  # an inbound lane silent this long is closed (its sender pings while it waits)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_frame: int = 64 << 20


@dataclass
class LaneStats:
    sent: int = 0  # frames written on the lane
    acked: int = 0
    received: int = 0  # frames read off the lane
    hot: int = 0  # handled on the reader thread
    declined: int = 0  # handed to the event loop
    fell_back: int = 0  # messages the transport carried instead (lane not open, full, broken)
    shortcut: int = 0  # of `hot`: taken from their bytes by the `Shortcut`, undecoded
    ahead: int = 0  # of `sent`: written `Ahead` of their messages
    lost: int = 0  # lanes that broke
    opened: int = 0
    bad_frames: int = 0


HotHandler = Callable[[str, Any, "Reply"], Any]  # (peer, msg, reply) -> HandlerResult | DECLINE | LATER


@dataclass(frozen=True)
class Known:
    """A frame a `Shortcut` recognised: the message's key and the frame's seq, its type's tag, the shortcut's own."""

    key: Key
    seq: int
    tag: str
    expected: Any


class Framing(Protocol):
    def frame(self, seq: int, msg: Any) -> bytes:
        """`msg`'s length-prefixed frame numbered `seq`, as `encode_frame` makes it."""
        ...


@dataclass(frozen=True)
class Taken:
    """A `Shortcut`'s answer: its sends, each with the layout that frames it (None: encoded as any message);
    `ahead`: the first is the message an `Ahead` frame was, already written (if the lane could)."""

    sends: tuple[Send, ...]
    framings: tuple[Framing | None, ...]
    ahead: bool = False


@dataclass(frozen=True)
class Ahead:
    """A `Shortcut`'s step whose output down the chain is ready before its messages: `frame(seq)` is that
    output's frame to `peer`, written at once; `then()`, called after the write, builds them and gives the
    step's `Taken` (that output first, as the message a retry or a repeat sends)."""

    peer: str
    frame: Callable[[int], bytes]
    then: Callable[[], Taken]


class Shortcut(Protocol):
    """Takes the frames it expects from their bytes alone (`swarmd.wire.follow`), before any decoding: a stage's
    next decode step of a request it just ran (`swarmd.inference.stage.next_step`)."""

    def follows(self, peer: str, body: bytes) -> Known | None:
        """`body` from `peer` if it is a frame this shortcut expects, else None (cheap: every frame asks)."""
        ...

    def take(self, known: Known, body: bytes, arrived: float) -> Taken | Ahead | Any:
        """Run it on the reader: `Taken`, `Ahead`, another HandlerResult, or DECLINE (the frame is then decoded
        and goes to the event loop)."""
        ...

    def ran(self, peer: str, what: Message | Known) -> None:
        """A hot handler ran `what` from `peer` on the reader (a message, or a frame this shortcut took) and its
        outputs are written: what to expect next (off the step's path)."""
        ...


@dataclass
class _Sent:
    msg: Message | None  # None: written `Ahead`, its message not built yet (`frame` has it)
    at: float
    frame: bytes = b""

    def message(self) -> Message:
        return self.msg if self.msg is not None else decode_body(self.frame[HEADER.size:]).msg


class _Out:
    """The lane to one destination (its sender side)."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.lock = threading.Lock()
        self.wire: DetachedStream | None = None
        self.pending: OrderedDict[int, _Sent] = OrderedDict()  # seq -> what waits for its ack, oldest first
        self.seq = 0
        self.liveness = Liveness(0.0)
        self.opening = False
        self.retry_at = -math.inf
        self.failures = 0
        self.last_error = ""


class _In:
    """One inbound lane (its receiver side); touched by its reader only."""

    def __init__(self, peer: str, wire: DetachedStream, max_frame: int) -> None:
        self.peer = peer
        self.wire = wire
        self.decoder = FrameDecoder(max_frame)
        self.acks: list[int] = []
        self.acks_since = 0.0  # when the oldest of `acks` was taken
        self.arrived = 0.0  # perf_counter when the bytes being read came off the socket
        self.ended = trio.Event()
        self.heard = 0.0


class Reply:
    """A later answer to one lane frame (`LATER`): `done(result)` once, from any thread."""

    def __init__(self, lane: HotLane, link: _In, seq: int, key: Any, msg: Message) -> None:
        self._lane, self._link, self._seq, self._key, self._msg = lane, link, seq, key, msg
        self._done = False
        self.arrived = link.arrived  # perf_counter when the frame's bytes came off the socket

    def done(self, result: HandlerResult) -> None:
        if self._done:
            return
        self._done = True
        self._lane._finish(self._link.peer, self._key, self._msg, result)
        with contextlib.suppress(StreamClosed):
            self._lane._write(self._link.wire, ack_frame(self._seq))

    def fail(self, error: BaseException) -> None:
        self.done(self._lane._error_result(self._link.peer, self._msg, error))


class HotLane:
    """The lane beside an `ActorTransport` on a `Network`. Start it with `await nursery.start(lane.run)`."""

    def __init__(self, network: Network, transport: ActorTransport, config: LaneConfig | None = None) -> None:
        self.network = network
        self.transport = transport
        self.config = config or LaneConfig(ack_timeout=transport.config.ack_timeout,
                                           max_frame=transport.config.max_frame)
        self.local_peer = transport.local_peer
        self.stats = LaneStats()
        self._routes: dict[type[Message], HotHandler] = {}
        self.shortcut: Shortcut | None = None  # asked first about every frame read
        self._out: dict[str, _Out] = {}
        self._out_lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._clock: trio.abc.Clock | None = None
        self._loop_thread = 0
        self._nursery: trio.Nursery | None = None
        self._rng = random.Random(random.getrandbits(64))  # from the process RNG: a simulation replays it

    # --- setup ---------------------------------------------------------------------------------------------

    def route(self, msg_type: type[Message], handler: HotHandler) -> None:
        """Run `handler(peer, msg, reply)` on the reader of the lane a `msg_type` message arrives on; the
        transport must route the type too (its checks apply, and it runs what the handler declines)."""
        if msg_type not in LANE_MESSAGES:
            raise ValueError(f"{msg_type.TAG} does not travel on the lane")
        self._routes[msg_type] = handler

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._clock = trio.lowlevel.current_clock()
        self._loop_thread = threading.get_ident()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.network.serve(LANE_PROTOCOL, self._serve, bulk=True)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            with self._out_lock:
                links = list(self._out.values())
            for link in links:
                wire = link.wire
                if wire is not None:
                    wire.close_now("the daemon is stopping")

    @property
    def running(self) -> bool:
        return self._nursery is not None

    def now(self) -> float:
        """The event loop's clock (`trio.current_time()`), read from any thread."""
        assert self._clock is not None
        return self._clock.current_time()

    def on_loop(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the event loop soon (from any thread; nothing if the loop has ended)."""
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(run_safely, fn, *args)

    # --- sending -------------------------------------------------------------------------------------------

    def send(self, peer: str, msg: Message, framing: Framing | None = None) -> bool:
        """From any thread: write `msg` on the lane to `peer` (framed by `framing` where given). True: the lane
        has it (delivered, or handed to the transport if the lane breaks before the ack); False: send it by the
        transport."""
        if not self.running or peer == self.local_peer or not isinstance(msg, LANE_MESSAGES):
            return False
        with self._out_lock:
            link = self._out.get(peer)
            if link is None:
                link = self._out[peer] = _Out(peer)
        now = self.now()
        with link.lock:
            wire = link.wire
            if wire is None or len(link.pending) >= self.config.window:
                if wire is None:
                    self._want(link, now)
                return False
            link.seq += 1
            seq = link.seq
            if not link.pending:
                link.liveness.heard(now)  # the wait for an ack starts now, not at the last answer
            link.pending[seq] = _Sent(msg, now)
        obs = self.transport.observer
        started = obs.now() if obs is not None else 0.0
        data = encode_frame(msg, seq) if framing is None else framing.frame(seq, msg)
        if obs is not None:  # (before the write: the ack may come back before this thread goes on)
            obs.encoded(peer, -seq, msg, started, len(data))
        try:
            self._write(wire, data)
        except StreamClosed as e:
            self._lost(link, wire, str(e))
        else:
            self.stats.sent += 1
        return True

    def _ahead_then(self, ahead: Ahead) -> tuple[Taken, tuple[_Out, int, int, float] | None]:
        """An `Ahead` step: its frame written where the lane takes it, then its `Taken` (always: until then the
        stage is busy); and what `_wrote_ahead` needs (None: not written)."""
        try:
            written = self._write_ahead(ahead.peer, ahead.frame)
        except Exception:  # ours to fix; the step's messages still go, as any others
            log.exception("a frame written ahead of its message failed")
            written = None
        return ahead.then(), written

    def _write_ahead(self, peer: str, frame: Callable[[int], bytes]) -> tuple[_Out, int, int, float] | None:
        """On a reader: write `frame(seq)` on the open lane to `peer` before its message exists (`Ahead`); what
        `_wrote_ahead` needs, or None where the lane cannot take it (its message then goes as any other)."""
        link = self._out.get(peer)
        if link is None or not self.running:
            return None
        obs = self.transport.observer
        started = obs.now() if obs is not None else 0.0
        now = self.now()
        with link.lock:
            wire = link.wire
            if wire is None or len(link.pending) >= self.config.window:
                return None
            link.seq += 1
            seq = link.seq
            if not link.pending:
                link.liveness.heard(now)
            data = frame(seq)
            link.pending[seq] = _Sent(None, now, data)
        try:
            self._write(wire, data)
        except StreamClosed as e:
            self._lost(link, wire, str(e))  # (the transport sends the message, decoded from `data`)
        else:
            self.stats.sent += 1
            self.stats.ahead += 1
        return link, seq, len(data), started

    def _wrote_ahead(self, written: tuple[_Out, int, int, float], msg: Message) -> None:
        """The message of a frame written ahead, for its retries, and the observer's count of it, timed from now
        (unless it was acked or lost meanwhile)."""
        link, seq, nbytes, started = written
        obs = self.transport.observer
        with link.lock:  # (an ack settles it after this)
            sent = link.pending.get(seq)
            if sent is None:
                return
            sent.msg, sent.frame = msg, b""
            if obs is not None:
                obs.encoded(link.peer, -seq, msg, started, nbytes)

    def take(self, sends: Sequence[Send], framings: Sequence[Framing | None] = ()) -> list[Send]:
        """From any thread: send what the lane can (each framed by its framing, where given); the rest (to return
        to the transport), in order."""
        framings = framings or (None,) * len(sends)
        return [s for s, f in zip(sends, framings, strict=True) if not self.send(s.peer, s.msg, f)]

    async def post_all(self, sends: Sequence[Send]) -> None:
        """On the event loop: `sends` by the lane where it can, the rest by the transport (`post_all`)."""
        rest = self.take(sends)
        if rest:
            await self.transport.post_all(rest)

    def _post_from_any_thread(self, sends: Sequence[Send], framings: Sequence[Framing | None] = ()) -> None:
        rest = self.take(sends, framings)
        if rest:
            self.stats.fell_back += len(rest)
            self.to_loop(self._spawn_post, rest)

    def _spawn_post(self, sends: list[Send]) -> None:
        self._start_soon(self._post_by_transport, sends)

    def _start_soon(self, fn: Callable[..., Any], *args: Any) -> bool:
        """A task in the lane's nursery; False when it is gone or closing (the daemon is stopping)."""
        if self._nursery is None:
            return False
        try:
            self._nursery.start_soon(fn, *args)
        except RuntimeError:
            return False
        return True

    async def _post_by_transport(self, sends: list[Send]) -> None:
        try:
            await self.transport.post_all(sends)
        except RuntimeError as e:  # the transport's nursery closed under us: the daemon is stopping
            log.debug("lane: %d messages not handed to the transport: %s", len(sends), e)

    def _write(self, wire: DetachedStream, data: bytes) -> None:
        wire.send(data, self.config.loop_write_wait if self.on_loop() else self.config.write_wait)

    def _lost(self, link: _Out, wire: DetachedStream, reason: str) -> None:
        """The stream under `link` is gone: whatever waits for an ack goes by the transport."""
        with link.lock:
            if link.wire is not wire:
                return
            link.wire = None
            link.last_error = reason[:300]
            seqs = list(link.pending)
            taken = [s.message() for s in link.pending.values()]
            link.pending.clear()
            link.retry_at = self.now() + self.config.retry.backoff(link.failures, self._rng)
            link.failures += 1
        wire.close_now(reason)
        self._settled(link.peer, seqs, acked=False)
        self.stats.lost += 1
        log.debug("lane to %s lost: %s (%d frames to the transport)", short_id(link.peer), reason, len(taken))
        if taken:
            self.stats.fell_back += len(taken)
            self.to_loop(self._spawn_post, [Send(link.peer, m) for m in taken])
        self.to_loop(self._link_lost, link.peer)

    def _link_lost(self, peer: str) -> None:
        if self.transport.on_link_lost is not None:
            with contextlib.suppress(Exception):
                self.transport.on_link_lost(peer)

    # --- opening lanes (on the event loop) ---------------------------------------------------------------

    def _want(self, link: _Out, now: float) -> None:
        """Ask for a lane to `link.peer` (its lock held): once at a time, after the backoff."""
        if not link.opening and now >= link.retry_at:
            link.opening = True
            self.to_loop(self._spawn_open, link)

    def _spawn_open(self, link: _Out) -> None:
        if not self._start_soon(self._open, link):
            link.opening = False

    async def _open(self, link: _Out) -> None:
        stream: Stream | None = None
        try:
            stream = await self.network.open_stream(link.peer, LANE_PROTOCOL, bulk=True)
            with trio.fail_after(HELLO_TIMEOUT):
                await stream.write(encode(Hello(self.config.max_frame)))
                await read_hello(stream)
            if not detachable(stream):
                await close_quietly(stream)
                stream = None
                with link.lock:
                    link.last_error = "the path to this peer cannot carry a lane (no data plane)"
                    link.retry_at = self.now() + self.config.no_lane_retry
                return
            wire: DetachedStream = stream.detach()  # type: ignore[attr-defined]
            stream = None
            with link.lock:
                link.wire = wire
                link.liveness = Liveness(self.config.ack_timeout, last_heard=self.now())
                link.last_error = ""
            self.stats.opened += 1
            wire.start(_OutReader(self, link, wire))
        except Exception as e:  # whatever a dial raises, the messages go by the transport meanwhile
            with link.lock:
                link.last_error = f"cannot open a lane: {type(e).__name__}: {e}"[:300]
                link.retry_at = self.now() + self.config.retry.backoff(link.failures, self._rng)
                link.failures += 1
            if stream is not None:
                await close_quietly(stream)
        finally:
            link.opening = False

    # --- serving lanes ---------------------------------------------------------------------------------------

    async def _serve(self, peer: str, stream: Stream) -> None:
        if self.network.gate.refusal(peer, trio.current_time()) is not None:
            return
        with trio.fail_after(HELLO_TIMEOUT):
            await read_hello(stream)
            await stream.write(encode(Hello(self.config.max_frame)))
        if not detachable(stream):
            return  # the dialer sees the same path and gives up on its side
        wire: DetachedStream = stream.detach()  # type: ignore[attr-defined]
        link = _In(peer, wire, self.config.max_frame)
        link.heard = self.now()
        wire.start(_InReader(self, link))
        try:
            await link.ended.wait()
        finally:
            wire.close_now("the lane was closed here")

    # --- receiving (on a lane's reader) ----------------------------------------------------------------------

    def _on_frame(self, link: _In, body: bytes) -> None:
        self.stats.received += 1
        if self.shortcut is not None and self._take_known(link, body):
            return
        obs = self.transport.observer
        started = obs.now() if obs is not None else 0.0
        try:
            env = decode_body(body)
            msg = env.msg
            if isinstance(msg, Ping):
                self._write(link.wire, encode(Pong(), env.seq))
                return
            if not isinstance(msg, LANE_MESSAGES):
                raise WireError("unexpected", f"{msg.TAG} does not travel on the lane", seq=env.seq)
            routed, expect = self.transport.expectation(type(msg))
            if not routed:
                raise WireError("unhandled", f"no actor here takes {msg.TAG} messages", seq=env.seq)
            if expect is not None:
                self.transport.check(expect, env.seq, msg)
        except WireError as e:
            self._bad_frame(link, e)
            return
        seq, peer = env.seq, link.peer
        if obs is not None:  # (a traced request's trace starts here: its handler then declines the hot path)
            obs.decoded(peer, msg, started, len(body))
        verdict = self.transport.begin(peer, msg, self.now())
        if verdict is None:  # over the peer's rate: the event loop waits it out, then acks
            self.stats.declined += 1
            self.to_loop(self.transport.admit_from_lane, peer, msg, _ack_later(self, link.wire, seq))
            return
        seen, cached = verdict
        if seen is not Seen.NEW:
            if seen is Seen.DONE and cached:
                self._post_from_any_thread(cached)  # a repeat: its answer again, never the step twice
            link.acks.append(seq)
            return
        handler = self._routes.get(type(msg))
        key = msg.key()
        if handler is None:
            result: Any = DECLINE
        else:
            try:
                result = handler(peer, msg, Reply(self, link, seq, key, msg))
            except Exception as e:
                result = self._error_result(peer, msg, e)
        if self._handled(link, seq, key, msg, result) and self.shortcut is not None:
            self.shortcut.ran(peer, msg)

    def _handled(self, link: _In, seq: int, key: Any, msg: Message, result: Any) -> bool:
        """A begun frame's handler answered `result`: send it and ack (True), or hand the frame to the event loop
        or wait for its later answer."""
        if result is DECLINE:
            self.stats.declined += 1
            self.to_loop(self.transport.admit_begun, link.peer, key, msg, _ack_later(self, link.wire, seq))
            return False
        self.stats.hot += 1
        if result is LATER:
            return False
        self._finish(link.peer, key, msg, result)
        link.acks.append(seq)
        return True

    def _take_known(self, link: _In, body: bytes) -> bool:
        """A frame the shortcut expects, run from its bytes; False: it takes the general path (not expected, or
        a repeat). It is not held to the peer's rate: a frame matches one expected step, once. What does not
        delay the step's output (its answer for repeats, the observer's count, what to expect next) comes after
        the output's write."""
        assert self.shortcut is not None
        known = self.shortcut.follows(link.peer, body)
        if known is None or not self.transport.begin_new(known.key, self.now()):
            return False
        written: tuple[_Out, int, int, float] | None = None
        try:
            result = self.shortcut.take(known, body, link.arrived)
            if isinstance(result, Ahead):
                result, written = self._ahead_then(result)
        except Exception as e:
            result = e
        if result is DECLINE or isinstance(result, Exception):
            try:
                msg = decode_body(body).msg
            except WireError as e:  # (a shortcut expects only frames that decode: ours to fix)
                self.transport.finish(known.key, ())
                self._bad_frame(link, e)
                return True
            if isinstance(result, Exception):
                result = self._error_result(link.peer, msg, result)
            self._handled(link, known.seq, known.key, msg, result)
            self._count(known, body)
            return True
        sends, framings = (result.sends, result.framings) if isinstance(result, Taken) else (as_sends(result), ())
        if written is not None and isinstance(result, Taken) and result.ahead:  # (else its frame is its message)
            self._wrote_ahead(written, sends[0].msg)
            self._post_from_any_thread(sends[1:], framings[1:])
        else:
            self._post_from_any_thread(sends, framings)
        self.transport.finish(known.key, sends)  # (a repeat meanwhile is acked as in progress; its retry replays)
        self._count(known, body)
        self.stats.hot += 1
        self.stats.shortcut += 1
        link.acks.append(known.seq)
        self.shortcut.ran(link.peer, known)
        return True

    def _count(self, known: Known, body: bytes) -> None:
        obs = self.transport.observer
        if obs is not None:
            obs.received(known.tag, len(body))

    def _finish(self, peer: str, key: Any, msg: Message, result: HandlerResult) -> None:
        sends = as_sends(result)
        if key is not None:
            self.transport.finish(key, sends)
        if not isinstance(result, Posted):
            self._post_from_any_thread(sends)

    def _error_result(self, peer: str, msg: Message, error: BaseException) -> Send:
        if isinstance(error, RemoteProtocolError):
            return Send(peer, error_reply(msg, getattr(error, "code", "bad_request"), str(error)))
        log.error("%s hot handler failed", msg.TAG, exc_info=error)
        return Send(peer, error_reply(msg, "internal", f"{type(error).__name__} in the {msg.TAG} handler"))

    def _bad_frame(self, link: _In, err: WireError) -> None:
        self.stats.bad_frames += 1
        log.info("bad lane frame from %s: %s", short_id(link.peer), err)
        with contextlib.suppress(StreamClosed):
            self._write(link.wire, encode(Error(err.code, err.message, request_id=err.request_id), err.seq or 0))
        self.to_loop(self.network.strike, link.peer, f"lane: {err.code}: {err.message}")

    def _ack_when_due(self, link: _In, now: float) -> float | None:
        """On an inbound lane's reader: write the acks gathered, once `ack_delay` has passed since the oldest or
        `ack_batch` wait (one write for many frames, and none on the step's way); the seconds until the next is due."""
        if not link.acks:
            return None
        if not link.acks_since:
            link.acks_since = now
        due = link.acks_since + self.config.ack_delay
        if now < due and len(link.acks) < self.config.ack_batch:
            return due - now
        data = b"".join(ack_frame(s) for s in link.acks)
        link.acks.clear()
        link.acks_since = 0.0
        with contextlib.suppress(StreamClosed):
            self._write(link.wire, data)
        return None

    # --- acks (on an outbound lane's reader) ------------------------------------------------------------------

    def _on_answer(self, link: _Out, wire: DetachedStream, body: bytes) -> None:
        env = decode_body(body)
        msg = env.msg
        now = self.now()
        refused: _Sent | None = None
        acked = False
        with link.lock:
            if link.wire is not wire:
                return
            link.liveness.heard(now)
            if isinstance(msg, Ack):
                if link.pending.pop(env.seq, None) is not None:
                    self.stats.acked += 1
                    acked = True
            elif isinstance(msg, Error) and env.seq:
                refused = link.pending.pop(env.seq, None)
            elif isinstance(msg, Error):
                raise StreamClosed(f"{msg.code}: {msg.message}")
            elif not isinstance(msg, Pong):
                raise StreamClosed(f"unexpected {msg.TAG} on a lane we opened")
        if acked or refused is not None:
            self._settled(link.peer, [env.seq], acked=acked)
        if refused is not None and isinstance(msg, Error):
            log.info("%s refused lane frame %d: %s: %s", short_id(link.peer), env.seq, msg.code, msg.message)
            self.to_loop(self.transport.undeliverable, link.peer, refused.message(), f"{msg.code}: {msg.message}")

    def _settled(self, peer: str, seqs: list[int], *, acked: bool) -> None:
        obs = self.transport.observer
        if obs is not None:
            for seq in seqs:
                obs.settled(peer, -seq, acked)

    def _check_liveness(self, link: _Out, wire: DetachedStream) -> float | None:
        """On the outbound reader: ping a silent peer, give the lane up when the ping goes unanswered."""
        now = self.now()
        with link.lock:
            if link.wire is not wire:
                return None
            oldest = next(iter(link.pending.values())).at if link.pending else None
            verdict = link.liveness.check(now, oldest)
            due = link.liveness.next_check(now, oldest)
        if verdict is Health.DEAD:
            raise StreamClosed(f"no answer for {2 * self.config.ack_timeout:.1f} s")
        if verdict is Health.PING:
            self._write(wire, encode(Ping(), 0))
        if due is None:
            return self.config.idle_timeout
        return max(due - now, 1e-3)

    # --- introspection -------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._out_lock:
            links = list(self._out.values())
        return {"stats": vars(self.stats).copy(),
                "lanes": {short_id(k.peer): {"open": k.wire is not None, "unacked": len(k.pending),
                                             "last_error": k.last_error} for k in links}}


class _OutReader:
    """Reads acks, refusals and pongs on a lane this daemon opened."""

    def __init__(self, lane: HotLane, link: _Out, wire: DetachedStream) -> None:
        self.lane, self.link, self.wire = lane, link, wire
        self.decoder = FrameDecoder(lane.config.max_frame)

    def data(self, chunk: bytes) -> None:
        self.decoder.feed(chunk)
        try:
            while (body := self.decoder.next_frame()) is not None:
                self.lane._on_answer(self.link, self.wire, body)
        except (WireError, FrameTooLarge) as e:
            raise StreamClosed(f"bad answer on the lane: {e}") from None

    def tick(self) -> float | None:
        return self.lane._check_liveness(self.link, self.wire)

    def closed(self, reason: str) -> None:
        self.lane._lost(self.link, self.wire, reason)


class _InReader:
    """Reads a lane opened to this daemon: each frame runs here, then the frames of one read are acked."""

    def __init__(self, lane: HotLane, link: _In) -> None:
        self.lane, self.link = lane, link

    def data(self, chunk: bytes) -> None:
        link = self.link
        link.arrived = time.perf_counter()
        link.heard = self.lane.now()
        link.decoder.feed(chunk)
        try:
            while (body := link.decoder.next_frame()) is not None:
                self.lane._on_frame(link, body)
        except FrameTooLarge as e:
            self.lane._bad_frame(link, WireError(e.code, str(e)))
            raise StreamClosed(str(e)) from None

    def tick(self) -> float | None:
        now = self.lane.now()
        idle = self.lane.config.idle_timeout - (now - self.link.heard)
        if idle <= 0:
            raise StreamClosed(f"nothing for {self.lane.config.idle_timeout:g} s")
        ack = self.lane._ack_when_due(self.link, now)
        return idle if ack is None else min(idle, ack)

    def closed(self, reason: str) -> None:
        self.lane.to_loop(self.link.ended.set)


def run_safely(fn: Callable[..., Any], *args: Any) -> None:
    """`fn(*args)` as a `run_sync_soon` callback, whose exceptions would end the whole trio run: logged instead
    (a nursery closed under a callback while the daemon stops, say)."""
    try:
        fn(*args)
    except Exception:
        log.exception("a callback from a lane's reader failed")


def _ack_later(lane: HotLane, wire: DetachedStream, seq: int) -> Callable[[], None]:
    def ack() -> None:
        with contextlib.suppress(StreamClosed):
            lane._write(wire, ack_frame(seq))

    return ack

