"""The head's queue: requests wait here, in turn, for a KV slot on every stage of the chain. Sans-IO.

A request arrives (`arrive`), waits, is granted (`grant`) once the chain has room for it, and is done
(`close`). The queue is bounded (`max_queued`) and fair across clients:

* order: requests put back (`requeue`: a stage was busy when it got there) go first, in the order they were
  put back; then the clients take turns, in the order they came, each client's own requests first come
  first served (round robin). One client's burst of 200 requests does not delay another client's single one
  by more than one request.
* bound: a newcomer to a full queue is refused, unless its client holds fewer queued requests than the client
  that holds the most: then that client's newest request is pushed out (`Arrival.evicted`, told to retry as
  one refused) and the newcomer takes its place, so that a burst cannot fill the queue against the others.

Every ticket's phase changes only through `TRANSITIONS`; an event the table does not allow is our bug
(`LocalProtocolError`). The trio driver (`swarmd.inference.head.service`) feeds it events and the clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from swarmd.errors import LocalProtocolError


class Phase(StrEnum):
    NEW = "new"
    QUEUED = "queued"  # waiting for its turn and a slot on every stage
    RUNNING = "running"  # granted: sent into the chain
    GONE = "gone"  # refused, evicted, left or done


TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (Phase.NEW, "arrive"): Phase.QUEUED,
    (Phase.NEW, "refuse"): Phase.GONE,  # the queue is full
    (Phase.QUEUED, "grant"): Phase.RUNNING,
    (Phase.QUEUED, "evict"): Phase.GONE,  # pushed out by a client holding fewer: it is told to retry later
    (Phase.QUEUED, "leave"): Phase.GONE,  # its client went away, or it failed while waiting
    (Phase.RUNNING, "requeue"): Phase.QUEUED,  # a stage had no room after all: back to the front
    (Phase.RUNNING, "finish"): Phase.GONE,
}

RATE_WINDOW = 60.0  # s of grants behind the Retry-After estimate
RETRY_MIN, RETRY_MAX = 1, 60  # s
WAITS_KEPT = 1024


@dataclass
class Ticket:
    id: int
    client: str
    arrived: float
    phase: Phase = Phase.NEW
    priority: bool = False  # put back after it ran: served before every client's turn
    queued_at: float = 0.0  # when it (last) entered the queue


@dataclass(frozen=True)
class Arrival:
    admitted: bool
    retry_after: int = 0  # s, when refused
    evicted: Ticket | None = None  # pushed out to make room (its waiter is told to retry after `retry_after`)


@dataclass
class RequestQueue:
    max_queued: int
    tickets: dict[int, Ticket] = field(default_factory=dict)  # every ticket not gone
    refused: int = 0  # turned away (full) or pushed out, since start
    _front: deque[int] = field(default_factory=deque)  # requeued tickets, first put back first
    _clients: OrderedDict[str, deque[int]] = field(default_factory=OrderedDict)  # in turn order
    _grants: deque[float] = field(default_factory=deque)  # times of recent grants (for Retry-After)
    _next_id: int = 0

    def __post_init__(self) -> None:
        if self.max_queued < 0:
            raise LocalProtocolError("max_queued cannot be negative")

    # --- the table ------------------------------------------------------------------------------------------

    def _move(self, ticket: Ticket, event: str) -> None:
        new = TRANSITIONS.get((ticket.phase, event))
        if new is None:
            raise LocalProtocolError(f"ticket {ticket.id}: {event} is not allowed while {ticket.phase.value}")
        ticket.phase = new
        if new is Phase.GONE:
            self.tickets.pop(ticket.id, None)

    # --- events ---------------------------------------------------------------------------------------------

    def arrive(self, client: str, now: float) -> tuple[Ticket, Arrival]:
        """A new request from `client`: queued, or refused when the queue is full (see the module's doc)."""
        ticket = Ticket(self._next_id, client, now)
        self._next_id += 1
        evicted = None
        if self.depth >= self.max_queued:
            evicted = self._longest_drop(client)
            if evicted is None:
                self._move(ticket, "refuse")
                self.refused += 1
                return ticket, Arrival(False, self.retry_after(now))
        self.tickets[ticket.id] = ticket
        self._move(ticket, "arrive")
        ticket.queued_at = now
        self._clients.setdefault(client, deque()).append(ticket.id)
        return ticket, Arrival(True, self.retry_after(now) if evicted else 0, evicted)

    def _longest_drop(self, client: str) -> Ticket | None:
        """The newest queued request of the client holding the most, if it holds more than `client` would."""
        mine = len(self._clients.get(client, ())) + 1
        best = max(self._clients.items(), key=lambda kv: len(kv[1]), default=None)
        if best is None or len(best[1]) < mine + 1:
            return None
        victim = self.tickets[best[1].pop()]
        self._drop_client_if_empty(best[0])
        self._move(victim, "evict")
        self.refused += 1
        return victim

    def peek(self) -> Ticket | None:
        """The request whose turn it is, if any waits."""
        if self._front:
            return self.tickets[self._front[0]]
        for ids in self._clients.values():
            return self.tickets[ids[0]]
        return None

    def grant(self, ticket_id: int, now: float) -> float:
        """The request at the front starts; how long it waited (s). Its client goes to the back of the turns."""
        head = self.peek()
        if head is None or head.id != ticket_id:
            raise LocalProtocolError(f"ticket {ticket_id} is granted out of turn")
        self._move(head, "grant")
        if head.priority:
            self._front.popleft()
        else:
            ids = self._clients.pop(head.client)
            ids.popleft()
            if ids:
                self._clients[head.client] = ids  # to the back of the turns
        self._grants.append(now)
        while self._grants and self._grants[0] < now - RATE_WINDOW:
            self._grants.popleft()
        return now - head.queued_at

    def requeue(self, ticket_id: int, now: float) -> None:
        """A running request goes back to the front (a stage had no room for it after all)."""
        ticket = self._get(ticket_id)
        self._move(ticket, "requeue")
        ticket.priority, ticket.queued_at = True, now
        self._front.append(ticket.id)

    def close(self, ticket_id: int) -> Phase:
        """The request is over, however it ended (finished, failed, its client went away); the phase it had.
        Closing a ticket already gone does nothing."""
        ticket = self.tickets.get(ticket_id)
        if ticket is None:
            return Phase.GONE
        was = ticket.phase
        if was is Phase.RUNNING:
            self._move(ticket, "finish")
        else:
            self._unlink(ticket)
            self._move(ticket, "leave")
        return was

    # --- what it says -----------------------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Requests waiting (requeued ones included)."""
        return len(self._front) + sum(len(ids) for ids in self._clients.values())

    @property
    def running(self) -> int:
        return sum(1 for t in self.tickets.values() if t.phase is Phase.RUNNING)

    def order(self) -> Iterator[int]:
        """Queued ticket ids in the order they will be granted (if nothing else arrives)."""
        yield from self._front
        turns = [list(ids) for ids in self._clients.values()]
        for r in range(max((len(ids) for ids in turns), default=0)):
            for ids in turns:
                if r < len(ids):
                    yield ids[r]

    def ahead_of(self, ticket_id: int) -> int:
        """How many queued requests go before this one (0: it is next)."""
        for n, tid in enumerate(self.order()):
            if tid == ticket_id:
                return n
        raise LocalProtocolError(f"ticket {ticket_id} is not queued")

    def retry_after(self, now: float) -> int:
        """Seconds a refused client should wait: the queue's depth at the rate requests were granted lately."""
        recent = [t for t in self._grants if t >= now - RATE_WINDOW]
        if len(recent) < 2:
            return 5 if self.depth else RETRY_MIN
        rate = (len(recent) - 1) / max(recent[-1] - recent[0], 1e-3)
        return int(min(RETRY_MAX, max(RETRY_MIN, math.ceil((self.depth + 1) / rate))))

    # --- internals --------------------------------------------------------------------------------------------

    def _get(self, ticket_id: int) -> Ticket:
        ticket = self.tickets.get(ticket_id)
        if ticket is None:
            raise LocalProtocolError(f"ticket {ticket_id} is gone")
        return ticket

    def _unlink(self, ticket: Ticket) -> None:
        if ticket.phase is not Phase.QUEUED:
            return
        if ticket.priority and ticket.id in self._front:
            self._front.remove(ticket.id)
            return
        ids = self._clients.get(ticket.client)
        if ids is not None and ticket.id in ids:
            ids.remove(ticket.id)
            self._drop_client_if_empty(ticket.client)

    def _drop_client_if_empty(self, client: str) -> None:
        if not self._clients.get(client, True):
            del self._clients[client]
