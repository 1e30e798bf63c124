"""Sans-IO state of reliable delivery: sequence numbers, acks, retry, liveness, de-duplication, limits.

Nothing here does I/O or reads a clock: every method takes `now` (seconds, any monotonic origin). The trio
code in `swarmd.transport.transport` drives these objects; tests drive them with plain numbers.

Sender side, per destination: an `Outbox` numbers frames and keeps each until it is acked, refused or past
its deadline; after a broken link every unacked frame is written again, in order, on the next one.
`Liveness` decides when a link whose frames go unanswered gets a ping and when it is declared dead.
`RetryPolicy` spaces reconnection attempts (exponential backoff with jitter). `Link` is the state of the
link to one destination (idle, connecting, connected, retired), changed only through `LINK_TRANSITIONS`.

Receiver side: a `DedupeTable` remembers, per message key `(type, request_id, step, hop)`, whether it was
delivered and what its handler produced, so a frame resent after a lost ack is acked again and its cached
result replayed instead of being handled twice (a KV cache must never append twice). The rates that bound
what one peer can make us do are `swarmd.net.rates`'.
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from swarmd.errors import LocalProtocolError

Key = tuple[str, str, int, int]


@dataclass(frozen=True)
class RetryPolicy:
    """Delay before reconnection attempt `attempt` (0-based): exponential, capped, with jitter."""

    initial: float = 0.02
    multiplier: float = 2.0
    maximum: float = 2.0
    jitter: float = 0.5  # the delay is drawn from [base * (1 - jitter), base]

    def backoff(self, attempt: int, rng: random.Random) -> float:
        base = min(self.maximum, self.initial * self.multiplier ** min(attempt, 64))
        return base * (1.0 - self.jitter * rng.random())


# --- sender -----------------------------------------------------------------------------------------------------


class Outcome(enum.Enum):
    ACKED = "acked"
    REFUSED = "refused"  # the receiver answered the frame with an Error
    EXPIRED = "expired"  # its deadline passed before an ack came


@dataclass(eq=False)
class Pending:
    """One frame awaiting its ack."""

    seq: int
    key: Key | None
    frame: bytes
    deadline: float
    session: int = -1  # the link session that last carried it; -1: never written
    sent_at: float = 0.0
    writes: int = 0
    outcome: Outcome | None = None
    refusal: Any = None  # the Error message when REFUSED
    context: Any = None  # owner's bookkeeping (the transport keeps its completion event here)


class Outbox:
    """Frames for one destination, in sequence order, until each is acked, refused or expired."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise LocalProtocolError("window must be >= 1")
        self.window = window
        self._next_seq = 1
        self._pending: OrderedDict[int, Pending] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def full(self) -> bool:
        return len(self._pending) >= self.window

    def next_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def add(self, pending: Pending) -> None:
        if self.full:
            raise LocalProtocolError("outbox window is full; wait for room before adding")
        self._pending[pending.seq] = pending

    def unsent(self, session: int) -> Iterator[Pending]:
        """Frames not yet written on link session `session`, oldest first (a new session resends all)."""
        return (p for p in list(self._pending.values()) if p.session != session)

    def mark_sent(self, pending: Pending, session: int, now: float) -> None:
        pending.session, pending.sent_at = session, now
        pending.writes += 1

    def oldest_unacked_sent_at(self, session: int) -> float | None:
        for p in self._pending.values():
            if p.session == session:
                return p.sent_at
        return None

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self._pending.values()), default=None)

    def complete(self, seq: int, outcome: Outcome, refusal: Any = None) -> Pending | None:
        """Settle frame `seq`; None if it is unknown or already settled (a late or repeated ack)."""
        p = self._pending.pop(seq, None)
        if p is not None:
            p.outcome, p.refusal = outcome, refusal
        return p

    def expire(self, now: float) -> list[Pending]:
        late = [p.seq for p in self._pending.values() if p.deadline <= now]
        return [p for seq in late if (p := self.complete(seq, Outcome.EXPIRED)) is not None]


class Health(enum.Enum):
    OK = "ok"
    PING = "ping"  # send a ping now
    DEAD = "dead"  # nothing heard after the ping: break the link


@dataclass
class Liveness:
    """When frames go unanswered for `ack_timeout`, ping; when the ping goes unanswered as long, give up.

    Anything heard from the peer (an ack, a pong) counts, so a receiver whose handlers are all busy — it
    delays acks on purpose to slow us down — keeps the link alive by answering pings from its reader.
    """

    ack_timeout: float
    last_heard: float = 0.0
    ping_at: float | None = None

    def heard(self, now: float) -> None:
        self.last_heard, self.ping_at = now, None

    def check(self, now: float, oldest_unacked_sent_at: float | None) -> Health:
        if oldest_unacked_sent_at is None:
            self.ping_at = None
            return Health.OK
        # The same sums as next_check's: `now - a >= t` can be false at `now == a + t` in floating point, and a
        # writer woken at next_check's time would then find nothing due and wait for that same time again.
        if self.ping_at is not None:
            return Health.DEAD if now >= self.ping_at + self.ack_timeout else Health.OK
        if now >= max(oldest_unacked_sent_at, self.last_heard) + self.ack_timeout:
            self.ping_at = now
            return Health.PING
        return Health.OK

    def next_check(self, now: float, oldest_unacked_sent_at: float | None) -> float | None:
        if oldest_unacked_sent_at is None:
            return None
        if self.ping_at is not None:
            return self.ping_at + self.ack_timeout
        return max(oldest_unacked_sent_at, self.last_heard) + self.ack_timeout


class LinkState(enum.Enum):
    IDLE = "idle"  # no stream: nothing to carry, or waiting out a backoff before the next try
    CONNECTING = "connecting"  # opening a stream
    CONNECTED = "connected"  # a session runs on an open stream
    RETIRED = "retired"  # idle too long: its task ended and a new link takes its place


class LinkEvent(enum.Enum):
    OPEN = "open"  # frames wait: open a stream
    OPENED = "opened"
    OPEN_FAILED = "open failed"
    SESSION_ENDED = "session ended"  # its stream broke or was closed
    IDLE_TIMEOUT = "idle timeout"  # nothing to carry for the idle timeout


LINK_TRANSITIONS: dict[tuple[LinkState, LinkEvent], LinkState] = {
    (LinkState.IDLE, LinkEvent.OPEN): LinkState.CONNECTING,
    (LinkState.CONNECTING, LinkEvent.OPENED): LinkState.CONNECTED,
    (LinkState.CONNECTING, LinkEvent.OPEN_FAILED): LinkState.IDLE,
    (LinkState.CONNECTED, LinkEvent.SESSION_ENDED): LinkState.IDLE,
    (LinkState.IDLE, LinkEvent.IDLE_TIMEOUT): LinkState.RETIRED,
}


@dataclass
class Link:
    """The link to one destination: its state, its sessions (one per stream opened: a frame last written on an
    older session is written again) and the tries in a row that carried nothing (the backoff's attempt)."""

    state: LinkState = LinkState.IDLE
    session: int = 0
    failures: int = 0

    @property
    def connected(self) -> bool:
        return self.state is LinkState.CONNECTED

    @property
    def retired(self) -> bool:
        return self.state is LinkState.RETIRED

    def open(self) -> None:
        self._fire(LinkEvent.OPEN)

    def opened(self) -> int:
        """The stream is open: a new session (its number)."""
        self._fire(LinkEvent.OPENED)
        self.session += 1
        return self.session

    def open_failed(self) -> None:
        self._fire(LinkEvent.OPEN_FAILED)
        self.failures += 1

    def session_ended(self, carried: bool) -> None:
        """The stream is gone; `carried`: some frame was acked on it (the link works: back off from the start)."""
        self._fire(LinkEvent.SESSION_ENDED)
        self.failures = 0 if carried else self.failures + 1

    def retire(self) -> None:
        self._fire(LinkEvent.IDLE_TIMEOUT)

    def backoff(self, policy: RetryPolicy, rng: random.Random) -> float:
        """How long to wait before the next try."""
        return policy.backoff(max(self.failures - 1, 0), rng)

    def _fire(self, event: LinkEvent) -> None:
        try:
            self.state = LINK_TRANSITIONS[(self.state, event)]
        except KeyError:
            raise LocalProtocolError(f"link: {event.value} while {self.state.value}") from None


# --- receiver -------------------------------------------------------------------------------------------------


class Seen(enum.Enum):
    NEW = "new"  # deliver it (now marked in progress)
    IN_PROGRESS = "in_progress"  # delivered, handler still running: ack, do nothing else
    DONE = "done"  # delivered and handled: ack and replay the cached result
    CLOSED = "closed"  # its request is over (cancelled): ack and drop


@dataclass
class _Entry:
    expires: float
    done: bool = False
    result: Any = None
    nbytes: int = 0


@dataclass
class DedupeStats:
    evicted_early: int = 0  # entries dropped before their TTL because the table was full
    results_dropped: int = 0  # cached results dropped to stay under the byte budget


class DedupeTable:
    """Which message keys were delivered, and the handler's result for each, for `ttl` seconds.

    `ttl` must outlast any sender's retry deadline: after that no duplicate can arrive. Results are kept
    under a byte budget (oldest dropped first; the key itself stays, so a duplicate is still not delivered
    twice, only its replay is lost). A closed request (`close`) drops its results and refuses its keys.
    """

    def __init__(self, ttl: float, max_entries: int, max_result_bytes: int) -> None:
        self.ttl, self.max_entries, self.max_result_bytes = ttl, max_entries, max_result_bytes
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()  # in order of first arrival
        self._closed: OrderedDict[str, float] = OrderedDict()  # request_id -> expiry
        self._by_request: dict[str, list[Key]] = {}
        self._result_bytes = 0
        self.stats = DedupeStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def result_bytes(self) -> int:
        return self._result_bytes

    def begin(self, key: Key, now: float) -> tuple[Seen, Any]:
        """Classify an arriving message; a NEW one is recorded as in progress."""
        self.prune(now)
        if key[1] in self._closed:
            return Seen.CLOSED, None
        entry = self._entries.get(key)
        if entry is not None:
            return (Seen.DONE, entry.result) if entry.done else (Seen.IN_PROGRESS, None)
        while len(self._entries) >= self.max_entries:
            self._evict_oldest()
            self.stats.evicted_early += 1
        self._entries[key] = _Entry(expires=now + self.ttl)
        self._by_request.setdefault(key[1], []).append(key)
        return Seen.NEW, None

    def finish(self, key: Key, result: Any, nbytes: int) -> None:
        """Record the handler's result for `key` (kept for replay while the byte budget allows)."""
        entry = self._entries.get(key)
        if entry is None:  # evicted or closed meanwhile: nothing to replay
            return
        entry.done = True
        if nbytes <= self.max_result_bytes:
            entry.result, entry.nbytes = result, nbytes
            self._result_bytes += nbytes
            self._trim_results()

    def close(self, request_id: str, now: float) -> None:
        """The request is over: forget its results, refuse its keys until the TTL passes."""
        for key in self._by_request.pop(request_id, []):
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._result_bytes -= entry.nbytes
        self._closed[request_id] = now + self.ttl
        self._closed.move_to_end(request_id)

    def prune(self, now: float) -> None:
        while self._entries:
            entry = next(iter(self._entries.values()))
            if entry.expires > now:
                break
            self._evict_oldest()
        while self._closed:
            rid, expires = next(iter(self._closed.items()))
            if expires > now:
                break
            del self._closed[rid]

    def _evict_oldest(self) -> None:
        key, entry = self._entries.popitem(last=False)
        self._result_bytes -= entry.nbytes
        keys = self._by_request.get(key[1])
        if keys is not None:
            keys.remove(key)
            if not keys:
                del self._by_request[key[1]]

    def _trim_results(self) -> None:
        for entry in self._entries.values():
            if self._result_bytes <= self.max_result_bytes:
                return
            if entry.nbytes:
                self._result_bytes -= entry.nbytes
                entry.result, entry.nbytes = None, 0
                self.stats.results_dropped += 1
