"""Actor transport: reliable, de-duplicated actor messages over one long-lived stream per neighbour.

The transport sees streams only through the network seam's `Stream` (`swarmd.transport.links` opens them as
bulk streams of a `Network`: libp2p, its TLS data plane, or the in-memory twin). State that decides (sequence numbers, acks, retry, liveness, de-duplication, limits) lives in
`swarmd.transport.delivery`; this module only does the I/O around it.

Sending: `await transport.send(peer, msg)` returns once the peer acked the frame (the peer decoded and
checked it and started its handler), raises `Refused` if the peer answered it with an `Error` (bad frame,
no handler...), and `DeliveryFailed` when the deadline passes (the frame may still have arrived: whatever
repeats it later is de-duplicated). `await transport.post(peer, msg)` returns once the frame is queued and
reports a failure to `on_undeliverable`; `on_link_lost(peer)` hears of every broken or unopenable stream
to a peer (the MoE router re-asks a replica instead of waiting for the retries). At most `window` frames and `window_bytes` bytes wait for acks per
destination, so a slow receiver slows the sender and memory does not grow. Each destination has one link
task: it opens a stream, reads acks, pings a peer that stops answering; when the stream breaks it reconnects
with exponential backoff and jitter and writes every unacked frame again, until each frame's deadline.
While the link is up and idle a sender writes its frame itself (one task switch less per hop), with any older
frame not yet written; `post_all` queues several messages and writes each link's frames in one write (a stage's
batch of outputs reaches the next stage together, in one read there). A message to `local_peer` (this daemon)
is handed to its handler in-process, with the same checks and de-duplication.

Receiving: `transport.route(Forward, handler, expect=...)` registers `async handler(peer, msg)`. A link's
reader task drains the stream at once (a libp2p sender whose window is not updated for 5 s resets the stream),
checks every frame (size, CBOR, type, version, fields, tensors, `expect`) and answers pings. A good frame is
admitted under per-peer and global handler limits and a per-peer rate — by the reader itself when nothing
waits, otherwise by the link's dispatcher task — and its handler runs in a task of its own. The reader acks
the frames of one read together once their handlers have begun, and reads on then (a stage's step is on its
compute thread's queue before the ack is written). A frame whose key was seen is acked without a second
delivery; if its handler has finished, its result is sent again. Bad frames get an `Error` reply; a peer with
too many is penalised in the peer gate (whose network drops its connections). Handler exceptions never escape: they
become `Error` messages to the sender.

What a handler returns is its result: `None`, a `Send(peer, msg)` or a list of them. The transport posts
them after the handler returns and caches them under the message's key for replay on a duplicate. A handler
that has posted its result itself (with `post_all`, together with other messages' results) returns it as
`Posted(sends)`: cached for replays, not posted again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import trio

from swarmd.errors import LocalProtocolError, RemoteProtocolError
from swarmd.net.framing import DEFAULT_MAX_FRAME, FrameDecoder, FrameTooLarge
from swarmd.net.gate import PeerGate
from swarmd.net.identity import short_id
from swarmd.net.rates import TokenBucket
from swarmd.net.seam import Stream
from swarmd.net.streams import close_quietly
from swarmd.tasks import spawn
from swarmd.transport.delivery import (
    DedupeTable,
    Health,
    Liveness,
    Outbox,
    Outcome,
    Pending,
    RetryPolicy,
    Seen,
)
from swarmd.wire.codec import WireError
from swarmd.wire.expect import Expect
from swarmd.wire.messages import (
    Ack,
    Cancel,
    Envelope,
    Error,
    Key,
    Message,
    Ping,
    Pong,
    decode,
    encode,
    request_id_of,
)

log = logging.getLogger(__name__)

Opener = Callable[[str], Awaitable[Stream]]


class FrameObserver(Protocol):
    """Told about every actor frame (timing, bytes; `swarmd.observe.hop_timer`). `now()` is its clock; the calls are
    synchronous and must be cheap: they sit on the path of every hop. The hot lane calls it from its readers'
    threads too, with its frames' seqs negated (its own numbering)."""

    def now(self) -> float: ...

    def encoded(self, peer: str, seq: int, msg: Message, started: float, nbytes: int) -> None: ...

    def settled(self, peer: str, seq: int, acked: bool) -> None: ...

    def decoded(self, peer: str, msg: Message, started: float, nbytes: int) -> None: ...

    def handling(self, msg: Message) -> None: ...

    def received(self, tag: str, nbytes: int) -> None: ...  # a frame of an untraced request taken undecoded


class LinkError(Exception):
    """A stream could not be opened, or broke."""


class DeliveryFailed(Exception):
    """A frame was not acked before its deadline."""

    def __init__(self, peer: str, msg: Message, reason: str) -> None:
        super().__init__(f"{msg.TAG} to {short_id(peer)} not delivered: {reason}")
        self.peer, self.msg, self.reason = peer, msg, reason


class Refused(RemoteProtocolError):
    """The receiver answered the frame with an Error (it will not be retried)."""

    def __init__(self, peer: str, error: Error) -> None:
        super().__init__(f"{short_id(peer)} refused the frame: {error.code}: {error.message}")
        self.peer, self.error = peer, error


@dataclass(frozen=True)
class TransportConfig:
    """Every limit and timing of the transport, in one place."""

    max_frame: int = DEFAULT_MAX_FRAME
    window: int = 32  # unacked frames per destination; also what a receiver buffers per link
    window_bytes: int = 64 << 20  # unacked bytes per destination (one larger frame may travel alone)
    send_timeout: float = 30.0  # default deadline of a send, retries included
    ack_timeout: float = 2.0  # unanswered this long: ping; ping unanswered as long: the link is dead
    connect_timeout: float = 10.0
    write_timeout: float = 10.0  # plus the time to write the frame at `min_rate`
    frame_timeout: float = 10.0  # to receive the rest of a started frame, plus its size at `min_rate`
    min_rate: float = 1e6  # bytes/s any healthy link sustains
    idle_timeout: float = 300.0  # a link with nothing to carry for this long is closed
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_handlers: int = 256  # handlers running at once, all peers together
    max_handlers_per_peer: int = 64
    frames_per_second: float = 5000.0  # per peer, admitted; over it acks slow down
    frame_burst: int = 500
    max_links_per_peer: int = 4
    dedupe_ttl: float = 120.0  # must outlast `send_timeout` (no duplicate can come after a sender gave up)
    dedupe_entries: int = 200_000
    dedupe_result_bytes: int = 256 << 20
    read_chunk: int = 1 << 16

    def io_time(self, base: float, nbytes: int) -> float:
        return base + nbytes / self.min_rate

    @property
    def link_buffer_bytes(self) -> int:
        """The most a well-behaved sender can have unacked, so the most a receiver buffers per link."""
        return max(self.window_bytes, self.max_frame)


@dataclass(frozen=True, slots=True)
class Send:
    """A handler's output: `msg` goes to `peer` (the sender itself for a reply)."""

    peer: str
    msg: Message


@dataclass(frozen=True, slots=True)
class Posted:
    """A handler's result that the handler has already handed to `ActorTransport.post_all`."""

    sends: tuple[Send, ...]


HandlerResult = Send | Sequence[Send] | Posted | None
Handler = Callable[[str, Any], Awaitable[HandlerResult]]


@dataclass(frozen=True)
class _Route:
    handler: Handler
    expect: Expect | None


@dataclass
class TransportStats:
    sent: int = 0  # frames acked
    resent: int = 0  # frames written again after a broken link
    reconnects: int = 0  # links opened after the first
    connect_failures: int = 0
    refused: int = 0  # our frames the peer answered with Error
    expired: int = 0  # our frames past their deadline
    delivered: int = 0  # handlers started
    duplicates: int = 0  # frames whose key was already delivered
    replays: int = 0  # cached results sent again for a duplicate
    dropped_closed: int = 0  # frames of a request already cancelled
    bad_frames: int = 0
    handler_errors: int = 0
    penalised: int = 0


class _LinkBroken(Exception):
    pass


class _NotAdmitted(_LinkBroken):
    """The transport's nursery is closing (the daemon stops): a frame read now is neither handled nor acked."""


class _Stopping(Exception):
    """A link asked for while the transport's nursery closes (the daemon is stopping)."""

    def __init__(self, peer: str) -> None:
        super().__init__(f"the transport is stopping: no new link to {short_id(peer)}")
        self.peer = peer


class _OutLink:
    """Sender side of the link to one destination."""

    def __init__(self, peer: str, cfg: TransportConfig) -> None:
        self.peer = peer
        self.outbox = Outbox(cfg.window)
        self.room = trio.Semaphore(cfg.window)
        self.unacked_bytes = 0
        self.bytes_freed = trio.Event()
        self.wakeup = trio.Event()
        self.session = 0
        self.stream: Stream | None = None  # the open stream, while a session runs
        self.session_scope: trio.CancelScope | None = None
        self.write_lock = trio.Lock()  # the link task and senders writing directly take turns
        self.writer_wake_at = math.inf  # when the link task will next look at the outbox by itself
        self.connected = False
        self.retired = False  # its task ended after a long idle spell; a new link takes over
        self.last_error = ""

    def wake(self) -> None:
        self.wakeup.set()

    def break_session(self, reason: str) -> None:
        """End the running session (the link task then reconnects and resends what is unacked)."""
        self.last_error = reason[:300]
        if self.session_scope is not None:
            self.session_scope.cancel()


class _InLink:
    """Receiver side of one inbound stream."""

    def __init__(self, peer: str, stream: Stream, bucket: TokenBucket, peer_slots: trio.Semaphore) -> None:
        self.peer = peer
        self.stream = stream
        self.write_lock = trio.Lock()
        self.scope = trio.CancelScope()
        self.bucket = bucket
        self.peer_slots = peer_slots
        self.queued_bytes = 0  # received, not yet admitted
        self.acks: list[int] = []  # frames the reader admitted, acked together once it has taken all it read


class ActorTransport:
    def __init__(
        self,
        opener: Opener,
        config: TransportConfig | None = None,
        *,
        local_peer: str = "",
        rng: random.Random | None = None,
        gate: PeerGate | None = None,
        on_undeliverable: Callable[[str, Message, str], None] | None = None,
    ) -> None:
        self.config = config or TransportConfig()
        self.local_peer = local_peer  # messages to this peer id are handed over in-process
        self._open = opener
        self._rng = rng or random.Random(random.getrandbits(64))  # from the process RNG: a simulation replays it
        self._gate = gate or PeerGate(self_id=local_peer)  # strikes and penalties, shared with the network
        self._report_undeliverable = on_undeliverable or _log_undeliverable
        # also told of every message given up (the MoE router asks another holder of a batch's experts)
        self.on_given_up: Callable[[str, Message, str], None] | None = None
        self._routes: dict[type[Message], _Route] = {}
        self._out: dict[str, _OutLink] = {}
        self._in: dict[str, set[_InLink]] = {}
        cfg = self.config
        self._dedupe = DedupeTable(cfg.dedupe_ttl, cfg.dedupe_entries, cfg.dedupe_result_bytes)
        # The de-duplication table and the rates are shared with the hot lane's readers (other threads).
        self._shared = threading.Lock()
        self._handlers = trio.Semaphore(cfg.max_handlers)
        self._peer_handlers: dict[str, trio.Semaphore] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._nursery: trio.Nursery | None = None
        self.stats = TransportStats()
        self.observer: FrameObserver | None = None
        # told of a peer whose stream broke or could not be opened (the frames to it are still retried)
        self.on_link_lost: Callable[[str], None] | None = None

    # --- setup -----------------------------------------------------------------------------------------------

    def route(self, msg_type: type[Message], handler: Handler, *, expect: Expect | None = None) -> None:
        """Deliver messages of `msg_type` to `handler(peer, msg)`; `expect` checks each before it is acked."""
        if msg_type.CONTROL:
            raise LocalProtocolError(f"{msg_type.TAG} is link control, not an actor message")
        self._routes[msg_type] = _Route(handler, expect)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled: link tasks and handlers live in this nursery."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for links in self._in.values():
                for link in links:
                    link.scope.cancel()

    @property
    def running(self) -> bool:
        return self._nursery is not None

    # --- sending ---------------------------------------------------------------------------------------------

    async def send(self, peer: str, msg: Message, *, within: float | None = None) -> None:
        """Deliver `msg` to `peer` and wait for its ack (retrying over broken links until the deadline)."""
        if self._nursery is None:
            raise DeliveryFailed(peer, msg, "the transport has stopped (the daemon is stopping)")
        await trio.lowlevel.checkpoint_if_cancelled()  # stopping: its link tasks' nursery may be closed already
        if peer == self.local_peer:
            await self._deliver_locally(msg)
            return
        deadline = trio.current_time() + (self.config.send_timeout if within is None else within)
        link, pending = await self._enqueue(peer, msg, deadline)
        await self._write_now(link)
        self._kick(link, pending)
        done: trio.Event = pending.context
        with trio.move_on_at(deadline):
            await done.wait()
        if pending.outcome is None:  # the deadline won the race against the link task's expiry
            self._settle(link, pending.seq, Outcome.EXPIRED)
        if pending.outcome is Outcome.REFUSED:
            raise Refused(peer, pending.refusal)
        if pending.outcome is Outcome.EXPIRED:
            raise DeliveryFailed(peer, msg, link.last_error or "no ack before the deadline")

    async def post(self, peer: str, msg: Message, *, within: float | None = None) -> None:
        """Queue `msg` for `peer` (waits only for window room); failures go to `on_undeliverable`."""
        if self._nursery is None:
            self._on_undeliverable(peer, msg, "the transport has stopped (the daemon is stopping)")
            return
        if peer == self.local_peer:
            try:
                await self._deliver_locally(msg)
            except Refused as e:
                self._on_undeliverable(peer, msg, e.error.message)
            return
        deadline = trio.current_time() + (self.config.send_timeout if within is None else within)
        link, pending = await self._enqueue(peer, msg, deadline)
        pending.context = msg  # no waiter: the link reports a failure itself
        await self._write_now(link)
        self._kick(link, pending)

    async def post_all(self, sends: Sequence[Send]) -> None:
        """`post` each of `sends`, writing each link's new frames together: one write, so the receiver reads
        them at once (a stage's batch stays one batch at the next stage). Messages to this daemon are handed
        over after the writes. A failure to queue one goes to `on_undeliverable`, like a post's."""
        queued: list[tuple[_OutLink, Pending]] = []
        if self._nursery is None:
            for out in sends:
                self._on_undeliverable(out.peer, out.msg, "the transport has stopped (the daemon is stopping)")
            return
        for out in sends:
            if out.peer == self.local_peer:
                continue  # after the writes: the other peers need not wait for this daemon's own handling
            try:
                link, pending = await self._enqueue(out.peer, out.msg,
                                                    trio.current_time() + self.config.send_timeout)
            except DeliveryFailed as e:
                self._on_undeliverable(out.peer, out.msg, e.reason)
                continue
            pending.context = out.msg
            queued.append((link, pending))
        for link in {id(link): link for link, _ in queued}.values():
            await self._write_now(link)
        for link, pending in queued:
            self._kick(link, pending)
        for out in sends:
            if out.peer == self.local_peer:
                await self.post(out.peer, out.msg)

    async def _deliver_locally(self, msg: Message) -> None:
        """A message to an actor of this daemon: the same checks, limits and de-duplication, no network."""
        route = self._routes.get(type(msg))
        if route is None:
            raise Refused(self.local_peer, Error("unhandled", f"no actor here takes {msg.TAG} messages"))
        if route.expect is not None:
            try:
                self._check_expect(route.expect, Envelope(0, msg))
            except WireError as e:
                raise Refused(self.local_peer, Error(e.code, e.message, request_id=e.request_id)) from None
        peer_slots = self._peer_handlers.setdefault(self.local_peer,
                                                    trio.Semaphore(self.config.max_handlers_per_peer))
        await peer_slots.acquire()
        try:
            await self._handlers.acquire()
        except BaseException:
            peer_slots.release()
            raise
        try:
            self._admit(self.local_peer, msg, (peer_slots, self._handlers))
        except _NotAdmitted as e:
            raise DeliveryFailed(self.local_peer, msg, str(e)) from None

    def _post_nowait(self, peer: str, msg: Message) -> bool:
        """Queue without waiting; False when the window is full (used for replays, which are best effort)."""
        if peer == self.local_peer:
            return False  # a local result was delivered in-process; there is no lost frame to make up for
        try:
            link = self._link(peer)
        except _Stopping:
            return False
        try:
            link.room.acquire_nowait()
        except trio.WouldBlock:
            return False
        pending = self._make(link, msg, trio.current_time() + self.config.send_timeout)
        if not self._bytes_room(link, pending):
            link.room.release()
            return False
        pending.context = msg
        self._push(link, pending)
        link.wake()
        return True

    def _link(self, peer: str) -> _OutLink:
        if self._nursery is None:
            raise LocalProtocolError("the transport is not running (start ActorTransport.run first)")
        link = self._out.get(peer)
        if link is None:
            link = _OutLink(peer, self.config)
            try:
                self._nursery.start_soon(self._run_link, link)
            except RuntimeError:  # the nursery is closing: the daemon stops, nothing more goes out
                raise _Stopping(peer) from None
            self._out[peer] = link
        return link

    async def _enqueue(self, peer: str, msg: Message, deadline: float) -> tuple[_OutLink, Pending]:
        """Wait for room in the window (frames, then bytes), then queue `msg` on the link to `peer`."""
        link = await self._frame_room(peer, msg, deadline)
        pending = self._make(link, msg, deadline)
        if not self._bytes_room(link, pending):
            with trio.move_on_at(deadline):
                while not self._bytes_room(link, pending):
                    try:
                        await link.bytes_freed.wait()
                    except BaseException:
                        link.room.release()
                        raise
            if not self._bytes_room(link, pending):
                link.room.release()
                self.stats.expired += 1
                raise DeliveryFailed(peer, msg, f"{link.unacked_bytes} bytes already waiting for acks")
        self._push(link, pending)
        return link, pending

    async def _frame_room(self, peer: str, msg: Message, deadline: float) -> _OutLink:
        try:
            link = self._link(peer)
            try:  # the common case: room in the window, no need to wait
                link.room.acquire_nowait()
                return link
            except trio.WouldBlock:
                pass
            with trio.move_on_at(deadline):
                while True:
                    link = self._link(peer)
                    await link.room.acquire()
                    if not link.retired:
                        return link
                    link.room.release()
        except _Stopping as e:
            raise DeliveryFailed(peer, msg, str(e)) from None
        self.stats.expired += 1
        raise DeliveryFailed(peer, msg, f"{self.config.window} frames already waiting for acks")

    def _make(self, link: _OutLink, msg: Message, deadline: float) -> Pending:
        """Number and encode `msg` (its frame slot is held; released here if encoding fails)."""
        seq = link.outbox.next_seq()
        obs = self.observer
        started = obs.now() if obs is not None else 0.0
        try:
            data = encode(msg, seq, max_frame=self.config.max_frame)
        except BaseException:
            link.room.release()
            raise
        if obs is not None:
            obs.encoded(link.peer, seq, msg, started, len(data))
        return Pending(seq, msg.key(), data, deadline, context=trio.Event())

    def _bytes_room(self, link: _OutLink, pending: Pending) -> bool:
        return link.unacked_bytes == 0 or link.unacked_bytes + len(pending.frame) <= self.config.window_bytes

    def _push(self, link: _OutLink, pending: Pending) -> None:
        link.outbox.add(pending)
        link.unacked_bytes += len(pending.frame)

    def _kick(self, link: _OutLink, pending: Pending) -> None:
        """Wake the link task if it must write `pending`, or watch it sooner than it planned to."""
        if pending.session != link.session:
            link.wake()
        elif min(pending.sent_at + self.config.ack_timeout, pending.deadline) < link.writer_wake_at:
            link.wake()

    async def _write_now(self, link: _OutLink) -> None:
        """Write the link's unwritten frames, oldest first and in one write, from the sender's own task when the
        link is up and idle: one task switch less per hop than handing them to the link task. Anything else
        (connecting, busy) is left to it."""
        stream, session = link.stream, link.session
        if stream is None or link.write_lock.locked():
            return
        frames = list(link.outbox.unsent(session))
        if not frames:
            return
        data = frames[0].frame if len(frames) == 1 else b"".join(p.frame for p in frames)
        link.write_lock.acquire_nowait()
        try:
            with trio.fail_after(self.config.io_time(self.config.write_timeout, len(data))):
                await stream.write(data)
            now = trio.current_time()
            for pending in frames:
                if pending.writes:
                    self.stats.resent += 1
                link.outbox.mark_sent(pending, session, now)
        except BaseException as e:  # a partly written frame leaves the stream unusable: start over
            link.break_session(f"link broke: {type(e).__name__}: {e}")
            if not isinstance(e, Exception):
                raise
        finally:
            link.write_lock.release()

    def _settle(self, link: _OutLink, seq: int, outcome: Outcome, refusal: Error | None = None) -> None:
        pending = link.outbox.complete(seq, outcome, refusal)
        if pending is not None:
            self._finish(link, pending)

    def _finish(self, link: _OutLink, pending: Pending) -> None:
        link.room.release()
        link.unacked_bytes -= len(pending.frame)
        link.bytes_freed.set()
        link.bytes_freed = trio.Event()
        if self.observer is not None:
            self.observer.settled(link.peer, pending.seq, pending.outcome is Outcome.ACKED)
        if pending.outcome is Outcome.ACKED:
            self.stats.sent += 1
        elif pending.outcome is Outcome.REFUSED:
            self.stats.refused += 1
        else:
            self.stats.expired += 1
        if isinstance(pending.context, trio.Event):
            pending.context.set()
        elif pending.outcome is not Outcome.ACKED:  # a post: nobody waits, so report it here
            reason = pending.refusal.message if pending.outcome is Outcome.REFUSED else (link.last_error or "deadline")
            self._on_undeliverable(link.peer, pending.context, reason)

    def _expire(self, link: _OutLink) -> None:
        for pending in link.outbox.expire(trio.current_time()):
            self._finish(link, pending)

    async def _run_link(self, link: _OutLink) -> None:
        """Keep a stream to `link.peer` while it has frames to carry; reconnect and resend when it breaks."""
        cfg, failures = self.config, 0
        while True:
            while not len(link.outbox):
                with trio.move_on_after(cfg.idle_timeout) as idle:
                    await link.wakeup.wait()
                link.wakeup = trio.Event()
                if idle.cancelled_caught and not len(link.outbox):
                    link.retired = True
                    del self._out[link.peer]
                    return
            stream = await self._connect(link)
            if stream is None:
                failures += 1
                await self._sleep_expiring(link, cfg.retry.backoff(failures - 1, self._rng))
                continue
            sent_before = self.stats.sent
            try:
                await self._session(link, stream)
            finally:
                link.connected = False
                await close_quietly(stream)
            failures = 0 if self.stats.sent > sent_before else failures + 1
            if len(link.outbox):
                await self._sleep_expiring(link, cfg.retry.backoff(max(failures - 1, 0), self._rng))

    async def _connect(self, link: _OutLink) -> Stream | None:
        deadline = min(trio.current_time() + self.config.connect_timeout, link.outbox.next_deadline() or math.inf)
        try:
            with trio.fail_after(max(0.0, deadline - trio.current_time())):
                stream = await self._open(link.peer)
        except Exception as e:  # whatever a dial raises, it is a failed attempt to retry
            why = f"{type(e).__name__}: {e}" if str(e) else ("no answer" if isinstance(e, trio.TooSlowError)
                                                             else type(e).__name__)
            link.last_error = f"cannot open a stream: {why}"[:300]
            self.stats.connect_failures += 1
            log.debug("link to %s: %s", short_id(link.peer), link.last_error)
            self._link_lost(link.peer)
            self._expire(link)
            return None
        if link.session:
            self.stats.reconnects += 1
        link.session += 1
        link.connected = True
        return stream

    async def _sleep_expiring(self, link: _OutLink, delay: float) -> None:
        until = trio.current_time() + delay
        while trio.current_time() < until:
            await trio.sleep_until(min(until, link.outbox.next_deadline() or math.inf))
            self._expire(link)

    async def _session(self, link: _OutLink, stream: Stream) -> None:
        health = Liveness(self.config.ack_timeout, last_heard=trio.current_time())
        try:
            async with trio.open_nursery() as nursery:
                link.stream, link.session_scope = stream, nursery.cancel_scope

                async def guard(fn: Callable[..., Awaitable[None]]) -> None:
                    try:
                        await fn(link, stream, health)
                    except Exception as e:  # stream errors of every kind (libp2p has its own) end the session
                        link.last_error = f"link broke: {type(e).__name__}: {e}"[:300]
                        log.debug("link to %s: %s", short_id(link.peer), link.last_error)
                        self._link_lost(link.peer)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(guard, self._write_frames)
                nursery.start_soon(guard, self._read_acks)
        finally:
            link.stream, link.session_scope = None, None

    async def _write_frames(self, link: _OutLink, stream: Stream, health: Liveness) -> None:
        cfg, session = self.config, link.session
        idle_since = trio.current_time()
        while True:
            for pending in link.outbox.unsent(session):
                await _acquire(link.write_lock)
                try:
                    if pending.session == session or pending.outcome is not None:
                        continue  # a sender wrote it meanwhile, or it was settled
                    with trio.fail_after(cfg.io_time(cfg.write_timeout, len(pending.frame))):
                        await stream.write(pending.frame)
                finally:
                    link.write_lock.release()
                if pending.writes:
                    self.stats.resent += 1
                link.outbox.mark_sent(pending, session, trio.current_time())
            now = trio.current_time()
            oldest = link.outbox.oldest_unacked_sent_at(session)
            verdict = health.check(now, oldest)
            if verdict is Health.DEAD:
                raise _LinkBroken(f"no answer for {2 * cfg.ack_timeout:.1f} s")
            if verdict is Health.PING:
                async with link.write_lock:
                    with trio.fail_after(cfg.write_timeout):
                        await stream.write(encode(Ping(), link.outbox.next_seq()))
            if len(link.outbox):
                idle_since = now
            elif now - idle_since >= cfg.idle_timeout:
                return  # nothing to carry for long: let the stream go; the next send opens another
            wake_at = min(
                health.next_check(now, link.outbox.oldest_unacked_sent_at(session)) or math.inf,
                link.outbox.next_deadline() or math.inf,
                idle_since + cfg.idle_timeout,
            )
            link.writer_wake_at = wake_at
            with trio.move_on_at(wake_at):
                await link.wakeup.wait()
            link.writer_wake_at = -math.inf  # busy: senders must not count on it looking soon
            link.wakeup = trio.Event()
            self._expire(link)

    async def _read_acks(self, link: _OutLink, stream: Stream, health: Liveness) -> None:
        # Unbounded waits are safe here: the writer ends the session when the peer goes silent.
        decoder = FrameDecoder(self.config.max_frame)
        while True:
            data = await stream.read(self.config.read_chunk)
            if not data:
                raise _LinkBroken("the peer closed the stream")
            decoder.feed(data)
            health.heard(trio.current_time())
            while (body := decoder.next_frame()) is not None:
                env = decode(body)
                if isinstance(env.msg, Ack):
                    self._settle(link, env.seq, Outcome.ACKED)
                elif isinstance(env.msg, Error) and env.seq:
                    self._settle(link, env.seq, Outcome.REFUSED, env.msg)
                    log.info("%s refused frame %d: %s: %s", short_id(link.peer), env.seq, env.msg.code, env.msg.message)
                elif isinstance(env.msg, Error):  # not about one frame: the receiver is closing the link on us
                    raise _LinkBroken(f"{env.msg.code}: {env.msg.message}")
                elif not isinstance(env.msg, Pong):
                    raise _LinkBroken(f"unexpected {env.msg.TAG} frame on a link we opened")

    # --- receiving -------------------------------------------------------------------------------------------

    def _link_lost(self, peer: str) -> None:
        if self.on_link_lost is not None:
            try:
                self.on_link_lost(peer)
            except Exception:  # a listener's bug must not end the link task
                log.exception("on_link_lost failed for %s", short_id(peer))

    async def serve(self, peer: str, stream: Stream) -> None:
        """Serve one inbound stream from `peer` until it closes. Never raises (a libp2p handler must not)."""
        try:
            if self._nursery is None or self._gate.refusal(peer, trio.current_time()) is not None:
                return
            links = self._in.setdefault(peer, set())
            if len(links) >= self.config.max_links_per_peer:
                log.info("refusing a stream from %s: %d already open", short_id(peer), len(links))
                return
            cfg = self.config
            bucket = self._buckets.setdefault(peer, TokenBucket(cfg.frames_per_second, cfg.frame_burst))
            peer_slots = self._peer_handlers.setdefault(peer, trio.Semaphore(cfg.max_handlers_per_peer))
            link = _InLink(peer, stream, bucket, peer_slots)
            links.add(link)
            try:
                with link.scope:
                    await self._serve_link(link)
            finally:
                links.discard(link)
                if not links:
                    self._in.pop(peer, None)
        except Exception:
            log.exception("link from %s ended by an unexpected error", short_id(peer))
        finally:
            await close_quietly(stream)

    async def _serve_link(self, link: _InLink) -> None:
        # Room for a full window; a sender that overruns it ignores the protocol.
        send, receive = trio.open_memory_channel[tuple[int, Message, int]](self.config.window)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._dispatch, link, receive)
            try:
                await self._read_frames(link, send)
            except (_LinkBroken, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                log.debug("link from %s: %s", short_id(link.peer), e)
            except Exception as e:  # a libp2p stream raises its own StreamError family
                log.debug("link from %s: %s: %s", short_id(link.peer), type(e).__name__, e)
            finally:
                nursery.cancel_scope.cancel()

    async def _read_frames(self, link: _InLink, queue: trio.MemorySendChannel[tuple[int, Message, int]]) -> None:
        cfg = self.config
        decoder = FrameDecoder(cfg.max_frame)
        frame_started = 0.0
        while True:
            if decoder.mid_frame:  # the whole frame must arrive in time, however it is dripped
                read_until = frame_started + cfg.io_time(cfg.frame_timeout, decoder.frame_length)
            else:
                read_until = trio.current_time() + cfg.idle_timeout
            with trio.move_on_at(read_until) as timer:
                data = await link.stream.read(cfg.read_chunk)
            if timer.cancelled_caught:
                log.info("closing link from %s: %s", short_id(link.peer), "a frame stalled" if decoder.mid_frame else "idle")
                return
            if not data:
                return
            if not decoder.mid_frame:
                frame_started = trio.current_time()
            decoder.feed(data)
            while True:
                try:
                    body = decoder.next_frame()
                except FrameTooLarge as e:  # the stream cannot be followed past an oversized length
                    await self._bad_frame(link, WireError(e.code, str(e)), seq=0, fatal=True)
                    return
                if body is None:
                    break
                await self._on_frame(link, body, queue)
            if link.acks:  # one write for the acks of every frame this read completed, once their handlers began
                await _let_started_handlers_begin()
                await self._reply(link, None, 0)
                if decoder.mid_frame:
                    frame_started = trio.current_time()

    async def _on_frame(self, link: _InLink, body: bytes, queue: trio.MemorySendChannel[tuple[int, Message, int]]) -> None:
        obs = self.observer
        started = obs.now() if obs is not None else 0.0
        try:
            env = decode(body)
            msg = env.msg
            if isinstance(msg, Ping):
                await self._reply(link, Pong(), env.seq)
                return
            if msg.CONTROL:
                raise WireError("unexpected", f"{msg.TAG} is not sent on an open link", seq=env.seq)
            route = self._routes.get(type(msg))
            if route is None:
                raise WireError("unhandled", f"no actor here takes {msg.TAG} messages", seq=env.seq)
            if route.expect is not None:
                self._check_expect(route.expect, env)
        except WireError as e:
            await self._bad_frame(link, e, seq=e.seq or 0)
            return
        if obs is not None:
            obs.decoded(link.peer, msg, started, len(body))
        if queue.statistics().current_buffer_used == 0 and self._try_admit_now(link, msg):
            link.acks.append(env.seq)  # admitted from the reader: no hand-over to the dispatcher
            return
        try:
            if link.queued_bytes + len(body) > self.config.link_buffer_bytes:
                raise trio.WouldBlock
            queue.send_nowait((env.seq, msg, len(body)))
            link.queued_bytes += len(body)
        except trio.WouldBlock:
            await self._bad_frame(link, WireError("window_exceeded", f"more than {self.config.window} frames or "
                                                  f"{self.config.link_buffer_bytes} bytes sent without waiting for "
                                                  "acks"), seq=env.seq, fatal=True)
            raise _LinkBroken("window exceeded") from None

    def _check_expect(self, expect: Expect, env: Envelope) -> None:
        try:
            expect(env.msg)
        except WireError as e:
            e.seq, e.request_id = env.seq, e.request_id or request_id_of(env.msg)
            raise
        except Exception as e:  # a check that crashes on odd input is our bug; the frame is still refused
            log.exception("expectation for %s failed", env.msg.TAG)
            raise WireError("bad_frame", f"{env.msg.TAG} failed the receiver's checks ({type(e).__name__})",
                            seq=env.seq, request_id=request_id_of(env.msg)) from None

    async def _bad_frame(self, link: _InLink, err: WireError, *, seq: int, fatal: bool = False) -> None:
        """Answer a bad frame with an Error and strike the peer; enough strikes and the gate cuts it off."""
        self.stats.bad_frames += 1
        log.info("bad frame from %s: %s", short_id(link.peer), err)
        await self._reply(link, Error(err.code, err.message, request_id=err.request_id), seq)
        if self._gate.strike(link.peer, trio.current_time(), f"actor transport: {err.code}: {err.message}"):
            self.stats.penalised += 1
            lim = self._gate.limits
            reason = f"more than {lim.bad_frames} bad frames in {lim.bad_frames_window:.0f} s"
            with trio.move_on_after(1.0):
                await self._reply(link, Error("penalised", f"{reason}; refused for {lim.penalty:.0f} s"), 0)
            for other in self._in.get(link.peer, ()):
                other.scope.cancel()
            raise _LinkBroken(reason)
        if fatal:
            raise _LinkBroken(err.message)

    def _try_admit_now(self, link: _InLink, msg: Message) -> bool:
        """Admit without waiting when the rate and both handler limits allow it at once."""
        if not link.bucket.try_take(trio.current_time()):
            return False
        try:
            link.peer_slots.acquire_nowait()
        except trio.WouldBlock:
            link.bucket.give_back()
            return False
        try:
            self._handlers.acquire_nowait()
        except trio.WouldBlock:
            link.peer_slots.release()
            link.bucket.give_back()
            return False
        self._admit(link.peer, msg, (link.peer_slots, self._handlers))
        return True

    async def _reply(self, link: _InLink, msg: Message | None, seq: int) -> None:
        """Write `msg` (if any) on the link, after the acks the reader has not written yet."""
        data = b"".join(encode(Ack(), s) for s in link.acks) + (encode(msg, seq) if msg is not None else b"")
        link.acks.clear()
        try:
            await _acquire(link.write_lock)
            try:
                with trio.fail_after(self.config.io_time(self.config.write_timeout, len(data))):
                    await link.stream.write(data)
            finally:
                link.write_lock.release()
        except trio.Cancelled:
            raise
        except Exception as e:
            raise _LinkBroken(f"cannot answer: {type(e).__name__}: {e}") from None

    async def _dispatch(self, link: _InLink, queue: trio.MemoryReceiveChannel[tuple[int, Message, int]]) -> None:
        peer, bucket, peer_slots = link.peer, link.bucket, link.peer_slots
        try:
            async for seq, msg, size in queue:
                link.queued_bytes -= size
                wait = bucket.take(trio.current_time())
                if wait > 0:
                    await trio.sleep(wait)
                await peer_slots.acquire()
                try:
                    await self._handlers.acquire()
                except BaseException:
                    peer_slots.release()
                    raise
                slots = (peer_slots, self._handlers)
                self._admit(peer, msg, slots)
                await self._reply(link, Ack(), seq)
        except _LinkBroken as e:
            log.debug("link from %s: %s", short_id(peer), e)
            link.scope.cancel()

    def _admit(self, peer: str, msg: Message, slots: tuple[trio.Semaphore, ...]) -> None:
        """Deliver `msg` unless its key was seen; no await between the check and the mark. Raises _NotAdmitted
        (the slots given back) once the transport stops."""
        key = msg.key()
        with self._shared:
            seen, cached = self._dedupe.begin(key, trio.current_time()) if key else (Seen.NEW, None)
            if seen is Seen.NEW and isinstance(msg, Cancel):
                self._dedupe.close(msg.request_id, trio.current_time())
        if seen is Seen.NEW:
            if not spawn(self._nursery, self._handle, peer, key, msg, slots):
                self._refuse_admission(slots)
            self.stats.delivered += 1
            return
        for s in slots:
            s.release()
        if seen is Seen.CLOSED:
            self.stats.dropped_closed += 1
            return
        self.stats.duplicates += 1
        if seen is Seen.DONE and cached:
            for out in cached:
                if self._post_nowait(out.peer, out.msg):
                    self.stats.replays += 1

    async def _handle(self, peer: str, key: Any, msg: Message, slots: tuple[trio.Semaphore, ...]) -> None:
        route = self._routes[type(msg)]
        if self.observer is not None:
            self.observer.handling(msg)
        try:
            posted = False
            try:
                result = await route.handler(peer, msg)
                posted = isinstance(result, Posted)
                sends = as_sends(result)
            except RemoteProtocolError as e:
                sends = (Send(peer, _error_for(msg, getattr(e, "code", "bad_request"), str(e))),)
            except Exception as e:
                self.stats.handler_errors += 1
                log.exception("%s handler failed", msg.TAG)
                sends = (Send(peer, _error_for(msg, "internal", f"{type(e).__name__} in the {msg.TAG} handler")),)
            if key is not None:
                self.finish(key, sends)
            if not posted:
                for out in sends:  # holding the handler slots until there is room: backpressure up the chain
                    try:
                        await self.post(out.peer, out.msg)
                    except DeliveryFailed as e:
                        self._on_undeliverable(out.peer, out.msg, e.reason)
        finally:
            for s in slots:
                s.release()

    # --- the hot lane's way in (`swarmd.transport.lane`: frames read by other threads) ----------------------

    def expectation(self, msg_type: type[Message]) -> tuple[bool, Expect | None]:
        """Whether messages of `msg_type` are routed here, and the check each must pass first."""
        route = self._routes.get(msg_type)
        return (route is not None, route.expect if route is not None else None)

    def check(self, expect: Expect, seq: int, msg: Message) -> None:
        """`expect(msg)` as a frame's check (WireError with the frame's seq and request)."""
        self._check_expect(expect, Envelope(seq, msg))

    def begin(self, peer: str, msg: Message, now: float) -> tuple[Seen, Any] | None:
        """From any thread: admit `msg` under the peer's rate and classify it as `_admit` does (a NEW one is
        marked in progress and must be `finish`ed); None when the rate says wait (`admit_from_lane` does)."""
        with self._shared:
            bucket = self._buckets.setdefault(peer, TokenBucket(self.config.frames_per_second,
                                                                self.config.frame_burst))
            if not bucket.try_take(now):
                return None
            key = msg.key()
            return self._dedupe.begin(key, now) if key else (Seen.NEW, None)

    def begin_new(self, key: Key, now: float) -> bool:
        """From any thread: `begin` for a frame known by its key alone (the lane's shortcut), with no rate. True:
        it is new, now marked in progress; False changes nothing (the frame then takes `begin`)."""
        with self._shared:
            return self._dedupe.begin(key, now)[0] is Seen.NEW

    def finish(self, key: Any, sends: tuple[Send, ...]) -> None:
        """From any thread: the handler of `key` is done; `sends` are replayed for a duplicate."""
        with self._shared:
            self._dedupe.finish(key, sends, sum(_approx_size(s.msg) for s in sends))

    @staticmethod
    def _refuse_admission(slots: tuple[trio.Semaphore, ...]) -> NoReturn:
        for s in slots:
            s.release()
        raise _NotAdmitted("the transport is stopping (the daemon stops)")

    def admit_begun(self, peer: str, key: Any, msg: Message, then: Callable[[], None]) -> None:
        """On the event loop: run the handler of a message `begin` marked new (the lane's reader declined to
        run it itself); `then()` once it is admitted (the lane acks it then)."""
        if spawn(self._nursery, self._admit_and_handle, peer, key, msg, then):
            self.stats.delivered += 1

    def admit_from_lane(self, peer: str, msg: Message, then: Callable[[], None]) -> None:
        """On the event loop: admit `msg` as a link's dispatcher does (waiting for the peer's rate and the
        handler limits), then `then()`."""
        spawn(self._nursery, self._admit_waiting, peer, msg, then)

    def _on_undeliverable(self, peer: str, msg: Message, reason: str) -> None:
        self._report_undeliverable(peer, msg, reason)
        if self.on_given_up is not None:
            try:
                self.on_given_up(peer, msg, reason)
            except Exception:  # a listener's bug must not end a link or a handler
                log.exception("on_given_up failed for %s", msg.TAG)

    def undeliverable(self, peer: str, msg: Message, reason: str) -> None:
        """On the event loop: `msg` to `peer` was refused or given up (as a post's failure is reported)."""
        self._on_undeliverable(peer, msg, reason)

    async def _admit_and_handle(self, peer: str, key: Any, msg: Message, then: Callable[[], None]) -> None:
        slots = await self._handler_slots(peer)
        then()
        await self._handle(peer, key, msg, slots)

    async def _admit_waiting(self, peer: str, msg: Message, then: Callable[[], None]) -> None:
        bucket = self._buckets.setdefault(peer, TokenBucket(self.config.frames_per_second, self.config.frame_burst))
        with self._shared:
            wait = bucket.take(trio.current_time())
        if wait > 0:
            await trio.sleep(wait)
        try:
            self._admit(peer, msg, await self._handler_slots(peer))
        except _NotAdmitted:
            return
        then()

    async def _handler_slots(self, peer: str) -> tuple[trio.Semaphore, ...]:
        peer_slots = self._peer_handlers.setdefault(peer, trio.Semaphore(self.config.max_handlers_per_peer))
        await peer_slots.acquire()
        try:
            await self._handlers.acquire()
        except BaseException:
            peer_slots.release()
            raise
        return (peer_slots, self._handlers)

    # --- introspection -------------------------------------------------------------------------------------

    def link_state(self) -> dict[str, dict[str, Any]]:
        """Per destination: connected, frames waiting for acks, last error."""
        return {
            peer: {"connected": link.connected, "unacked": len(link.outbox), "last_error": link.last_error}
            for peer, link in self._out.items()
        }


async def _let_started_handlers_begin() -> None:
    """Return once the handlers a reader has just started have run to their first wait.

    The reader acks its frames and reads on after that, so a handler that starts work (a stage handing its
    step to the compute thread) does so first; the ack's encoding and TLS write and the next read's attempt
    then overlap the compute thread's wake-up rather than come before it, and are done before this thread
    blocks (why not later: docs/BENCHMARKS.md, "Per-hop overhead against 1 ms"). trio runs the tasks of one
    scheduler batch in either order, so one checkpoint is not enough: a task made ready before the first
    checkpoint runs in the batch after it, which ends before the second checkpoint returns."""
    await trio.lowlevel.checkpoint()
    await trio.lowlevel.checkpoint()


async def _acquire(lock: trio.Lock) -> None:
    """Take `lock`, yielding to the scheduler only when it is held (trio's acquire always yields)."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


def as_sends(result: HandlerResult) -> tuple[Send, ...]:
    """A handler's result as the sends it makes (for one already posted, those `Posted` holds)."""
    if result is None:
        return ()
    if isinstance(result, Posted):
        return result.sends
    if isinstance(result, Send):
        return (result,)
    sends = tuple(result)
    if not all(isinstance(s, Send) for s in sends):
        raise LocalProtocolError("a handler must return None, a Send or a sequence of Send")
    return sends


def error_reply(msg: Message, code: str, message: str) -> Error:
    """The `Error` a handler's failure sends back about `msg`."""
    return _error_for(msg, code, message)


def _error_for(msg: Message, code: str, message: str) -> Error:
    key = msg.key() or ("", "", 0, 0)
    return Error(code[:64] or "error", message[:1000], request_id=request_id_of(msg), step=key[2], hop=key[3])


def _approx_size(msg: Message) -> int:
    size = 256
    for name in _tensor_fields(type(msg)):
        value = getattr(msg, name)
        if value is not None:
            size += value.nbytes
    return size


@functools.cache
def _tensor_fields(cls: type) -> tuple[str, ...]:
    """The fields of a message type that hold a WireTensor (or None)."""
    return tuple(f.name for f in dataclasses.fields(cls) if "WireTensor" in str(f.type))


def _log_undeliverable(peer: str, msg: Message, reason: str) -> None:
    log.warning("%s for %s to %s not delivered: %s", msg.TAG, request_id_of(msg) or "-", short_id(peer), reason)
