"""The head's queue, driven: requests wait their turn here until every stage of the chain has a KV slot free.

    turn = admission.admit(client)            # HeadError 429 (queue full, with retry_after) or 503 (leaving)
    registry = await admission.wait_turn(turn) # the chain it may start on; 503 if the swarm cannot serve
    ...                                        # send it into the chain
    admission.close(turn)                      # however it ended: its slots count as free again

The decisions are `RequestQueue`'s (order, bound, fairness: `swarmd.inference.head.queue`) and `SlotView`'s (free
slots per stage: `swarmd.inference.head.slots`); this module only does the waiting and the waking. One task
(`run`) grants turns: when a request arrives or ends, and every `DISPATCH_POLL` while some wait (the stages'
gossiped slot counts change between heartbeats). A request a stage refused as busy goes back to the front
(`requeue`). A queued request does not depend on the plan: it keeps its place across a re-plan or failover and
starts on whatever chain is ready when its turn comes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from swarmd.config import Timings
from swarmd.inference.head.queue import Phase, RequestQueue, Ticket
from swarmd.inference.head.slots import SlotView, StageSlots
from swarmd.inference.registry import ChainStatus, Registry

DISPATCH_POLL = 0.05  # s between looks at the stages' slots while requests wait
SAY_POLL = 0.2  # s between updates of what a waiting request is told
TOO_SMALL_GRACE = 5.0  # s a waiting request gives the swarm once the leader says the model no longer fits it

OnWait = Callable[[str], Awaitable[None]]


class QueueFull(Exception):
    """Raised by `admit` (and by `wait_turn` for a request pushed out): retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


class Closed(Exception):
    """The request's place was given up (its client went away) while something still waited for its turn."""


class NotReady(Exception):
    """The swarm cannot serve: no ready chain within the deadline, or it can no longer hold the model."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(eq=False)
class Turn:
    """One request's place: queued until `granted`; then the chain it runs on (`chain`) until closed."""

    ticket: Ticket
    arrived: float  # perf_counter seconds
    granted: trio.Event = field(default_factory=trio.Event)
    registry: Registry | None = None  # the chain it was granted
    pushed_out: QueueFull | None = None
    closed: bool = False
    waited: float = 0.0  # s in the queue, all its waits together

    @property
    def chain(self) -> tuple[str, ...]:
        return self.registry.stages if self.registry is not None else ()


class Admission:
    def __init__(self, *, chain: Callable[[], ChainStatus], registry: Callable[[], Registry],
                 capacity: Callable[[], Mapping[str, StageSlots | None]], timings: Timings, max_queued: int,
                 in_flight: Callable[[int], None] = lambda delta: None) -> None:
        self._chain, self._registry, self._capacity = chain, registry, capacity
        self.timings = timings
        self.queue = RequestQueue(max_queued)
        self.view = SlotView()
        self._turns: dict[int, Turn] = {}
        self._in_flight = in_flight
        self._wake = trio.Event()
        self.on_wait_time: Callable[[float], None] | None = None  # metrics: seconds each request waited

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        while True:
            with trio.move_on_after(DISPATCH_POLL if self.queue.depth else math.inf):
                await self._wake.wait()
            self._wake = trio.Event()
            self.grant_ready()

    # --- a request's way through ------------------------------------------------------------------------------

    def admit(self, client: str) -> Turn:
        """A place in the queue for a request of `client`; QueueFull when there is none."""
        now = trio.current_time()
        ticket, arrival = self.queue.arrive(client, now)
        if arrival.evicted is not None:
            pushed = self._turns.pop(arrival.evicted.id)
            pushed.pushed_out = QueueFull(self._full_message(arrival.retry_after), arrival.retry_after)
            self._in_flight(-1)
            pushed.granted.set()
        if not arrival.admitted:
            raise QueueFull(self._full_message(arrival.retry_after), arrival.retry_after)
        turn = Turn(ticket, time.perf_counter())
        self._turns[ticket.id] = turn
        self._in_flight(+1)
        self.grant_ready()  # its turn may be now: a burst fills the chain's free slots before the queue's places
        self._wake.set()
        return turn

    def _full_message(self, retry_after: int) -> str:
        return (f"this daemon is busy: {self.queue.depth} requests already wait for the swarm (--max-queued "
                f"{self.queue.max_queued}); retry in {retry_after} s")

    async def wait_turn(self, turn: Turn, on_wait: OnWait | None = None, *, within: float | None = None,
                        give_up_when_too_small: bool = False) -> Registry:
        """Wait until the request may start; the chain to send it to. NotReady when no chain is ready for
        `within` seconds (the daemon's `ready_timeout` by default) or, with `give_up_when_too_small`, a few
        seconds after the swarm says it can no longer hold the model; QueueFull when it was pushed out."""
        timeout = self.timings.ready_timeout if within is None else within
        self.grant_ready()
        said = ""
        unready_since: float | None = None
        too_small_since: float | None = None
        while not turn.granted.is_set():
            now = trio.current_time()
            status = self._chain()
            if status.ready:
                unready_since = too_small_since = None
                with trio.move_on_after(2 * DISPATCH_POLL):  # its turn may come at the next look
                    await turn.granted.wait()
                if turn.granted.is_set():
                    break
                ahead = self.queue.ahead_of(turn.ticket.id) if turn.ticket.phase is Phase.QUEUED else 0
                detail = f"queued: {ahead} request{'s' if ahead != 1 else ''} ahead, waiting for a free slot"
            else:
                unready_since = now if unready_since is None else unready_since
                too_small_since = (now if too_small_since is None else too_small_since) if status.cannot_hold else None
                if give_up_when_too_small and too_small_since is not None and now - too_small_since >= TOO_SMALL_GRACE:
                    raise NotReady("swarm_too_small", f"the swarm can no longer hold the model: {status.detail}")
                if now - unready_since >= timeout:
                    raise NotReady("not_ready", f"the swarm is not ready after {timeout:.0f} s: {status.detail}")
                detail = status.detail
            if on_wait is not None and detail != said:
                await on_wait(detail)
                said = detail
            with trio.move_on_after(SAY_POLL):
                await turn.granted.wait()
        if turn.pushed_out is not None:
            raise turn.pushed_out
        if turn.closed:
            raise Closed()
        assert turn.registry is not None
        return turn.registry

    def grant_ready(self) -> None:
        """Start every request whose turn it is while the current chain has room for one more."""
        if not self.queue.depth:
            return
        status = self._chain()
        if not status.ready:
            return
        registry = self._registry()
        self.view.report(self._capacity())
        now = trio.current_time()
        while (ticket := self.queue.peek()) is not None and self.view.can_start(registry.stages, now):
            waited = self.queue.grant(ticket.id, now)
            turn = self._turns[ticket.id]
            turn.registry = registry
            turn.waited += waited
            self.view.started(registry.stages)
            if self.on_wait_time is not None:
                self.on_wait_time(waited)
            turn.granted.set()

    def moved(self, turn: Turn, registry: Registry) -> None:
        """The request was sent to another chain (a move): its slots there count, those of the old chain not."""
        if turn.ticket.phase is Phase.RUNNING:
            self.view.ended(turn.chain)
            self.view.started(registry.stages)
        turn.registry = registry
        self._wake.set()

    def requeue(self, turn: Turn, busy_peer: str | None) -> None:
        """A stage (`busy_peer`) had no slot for the request after all: back to the front of the queue."""
        if turn.ticket.phase is not Phase.RUNNING:
            return
        self.view.ended(turn.chain)
        if busy_peer is not None:  # after `ended`, which would count the busy stage as having room again
            self.view.refused(busy_peer, trio.current_time())
        turn.registry, turn.granted = None, trio.Event()
        self.queue.requeue(turn.ticket.id, trio.current_time())
        self._wake.set()

    def close(self, turn: Turn) -> None:
        """The request is over, however it ended; its slots count as free. Closing twice does nothing."""
        if self._turns.pop(turn.ticket.id, None) is None:
            return
        if self.queue.close(turn.ticket.id) is Phase.RUNNING:
            self.view.ended(turn.chain)
        turn.closed = True
        turn.granted.set()  # whatever still waits for its turn stops waiting
        self._in_flight(-1)
        self._wake.set()

    # --- what it says -----------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """For `swarmd status` and /api/v0/pipeline: the queue and the chain's slots as this head sees them."""
        registry = self._registry()
        self.view.report(self._capacity())  # (else it is refreshed only while requests wait)
        return {
            "max_queued": self.queue.max_queued, "queued": self.queue.depth, "running": self.queue.running,
            "refused": self.queue.refused, "retry_after_s": self.queue.retry_after(trio.current_time()),
            "stages": [{"hop": hop, "peer_id": peer, "slots": self.view.total(peer), "used": self.view.used(peer)}
                       for hop, peer in enumerate(registry.stages)],
        }
