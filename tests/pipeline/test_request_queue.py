"""The head's queue (sans-IO): bounded, first come first served within a client, clients served in turn, a burst
never crowding out another client, requests put back first; every phase change through its one table."""

from __future__ import annotations

import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from swarmd.errors import LocalProtocolError
from swarmd.inference.head.queue import TRANSITIONS, Phase, RequestQueue

CLIENTS = ("a", "b", "c", "d")


def test_a_burst_from_one_client_does_not_delay_another_clients_single_request():
    q = RequestQueue(256)
    burst = [q.arrive("burst", now=0.0)[0] for _ in range(200)]
    single, _ = q.arrive("single", now=1.0)
    granted = []
    for t in range(3):
        head = q.peek()
        q.grant(head.id, now=2.0 + t)
        granted.append(head.id)
    assert granted == [burst[0].id, single.id, burst[1].id]


def test_a_full_queue_refuses_a_newcomer_of_the_client_holding_the_most_with_a_time_to_retry():
    q = RequestQueue(4)
    for _ in range(4):
        assert q.arrive("a", now=0.0)[1].admitted
    ticket, arrival = q.arrive("a", now=0.0)
    assert not arrival.admitted and arrival.retry_after >= 1 and ticket.phase is Phase.GONE
    assert q.depth == 4 and q.refused == 1


def test_a_full_queue_makes_room_for_another_client_by_pushing_out_the_burst_s_newest():
    q = RequestQueue(4)
    burst = [q.arrive("a", now=float(i))[0] for i in range(4)]
    _, arrival = q.arrive("b", now=5.0)
    assert arrival.admitted and arrival.evicted is burst[-1] and burst[-1].phase is Phase.GONE
    assert arrival.retry_after >= 1 and q.depth == 4 and q.refused == 1
    _, again = q.arrive("c", now=6.0)  # a still holds 3, c would hold 1: a gives up its newest again
    assert again.evicted is burst[-2]
    _, last = q.arrive("d", now=7.0)  # a holds 2, more than d would
    assert last.evicted is burst[-3]
    _, fair = q.arrive("e", now=8.0)  # a, b, c and d hold one each: no one holds more than e would
    assert not fair.admitted and fair.evicted is None and q.refused == 4


def test_a_request_put_back_goes_before_every_client_and_keeps_its_ticket():
    q = RequestQueue(8)
    first, _ = q.arrive("a", now=0.0)
    q.grant(first.id, now=1.0)
    others = [q.arrive(c, now=2.0)[0] for c in "bcd"]
    q.requeue(first.id, now=3.0)
    assert q.peek() is first and q.ahead_of(first.id) == 0 and q.ahead_of(others[0].id) == 1
    assert q.grant(first.id, now=4.0) == pytest.approx(1.0)  # it waited since it was put back


def test_retry_after_follows_the_rate_at_which_turns_come():
    q = RequestQueue(100)
    for _ in range(40):
        q.arrive("a", now=0.0)
    for i in range(10):  # two grants a second
        q.grant(q.peek().id, now=10.0 + i / 2)
    assert q.retry_after(now=15.0) == pytest.approx(31 / 2, abs=1)  # 30 waiting, and one more


def test_events_the_table_does_not_allow_are_our_bug():
    q = RequestQueue(4)
    a, _ = q.arrive("a", now=0.0)
    b, _ = q.arrive("b", now=0.0)
    with pytest.raises(LocalProtocolError):
        q.grant(b.id, now=1.0)  # out of turn
    with pytest.raises(LocalProtocolError):
        q.requeue(a.id, now=1.0)  # it never ran
    q.grant(a.id, now=1.0)
    assert q.close(a.id) is Phase.RUNNING and q.close(a.id) is Phase.GONE  # closing twice does nothing
    assert {event for (_, event) in TRANSITIONS} == {"arrive", "refuse", "grant", "evict", "leave", "requeue", "finish"}


class QueueMachine(RuleBasedStateMachine):
    """Random arrivals, grants, requeues and departures; after each, what the queue says is checked against a
    plain model of it, and each grant against the rules of turn."""

    def __init__(self) -> None:
        super().__init__()
        self.q = RequestQueue(6)
        self.now = 0.0
        self.client_of: dict[int, str] = {}
        self.queued: dict[str, list[int]] = {c: [] for c in CLIENTS}  # each client's waiting tickets, oldest first
        self.front: list[int] = []  # tickets put back, in order
        self.running: set[int] = set()
        self.grants = 0
        self.last_grant: dict[str, int] = {}  # client -> index of its latest grant
        self.waiting_since: dict[str, int] = {}  # client -> grant index when it started waiting without a break

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    @rule(client=st.sampled_from(CLIENTS))
    def arrive(self, client: str) -> None:
        full = sum(map(len, self.queued.values())) + len(self.front) >= self.q.max_queued
        ticket, arrival = self.q.arrive(client, self.tick())
        if not full:
            assert arrival.admitted and arrival.evicted is None
        longest = max(CLIENTS, key=lambda c: len(self.queued[c]))
        if arrival.evicted is not None:
            victim = arrival.evicted
            assert full and len(self.queued[victim.client]) == len(self.queued[longest])
            assert len(self.queued[victim.client]) > len(self.queued[client]) + 1
            assert self.queued[victim.client][-1] == victim.id  # its newest
            self.queued[victim.client].pop()
        if not arrival.admitted:
            assert full and len(self.queued[longest]) <= len(self.queued[client]) + 1
            return
        if not self.queued[client]:
            self.waiting_since[client] = self.grants
        self.queued[client].append(ticket.id)
        self.client_of[ticket.id] = client

    @precondition(lambda self: self.q.depth > 0)
    @rule()
    def grant(self) -> None:
        expected_order = list(self.q.order())
        ticket = self.q.peek()
        assert ticket.id == expected_order[0]
        self.q.grant(ticket.id, self.tick())
        if self.front:
            assert ticket.id == self.front.pop(0)  # put back ones first, in order
        else:
            client = ticket.client
            assert ticket.id == self.queued[client][0]  # a client's own requests first come first served
            previous = self.last_grant.get(client)
            for other in CLIENTS:  # no client waiting since before this one's last turn was passed over
                if other != client and self.queued[other] and previous is not None \
                        and self.waiting_since[other] <= previous:
                    assert self.last_grant.get(other, -1) > previous, (client, other)
            self.queued[client].pop(0)
            self.last_grant[client] = self.grants
            if self.queued[client]:
                self.waiting_since[client] = min(self.waiting_since[client], self.grants)
        self.grants += 1
        self.running.add(ticket.id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def requeue(self, data) -> None:
        tid = data.draw(st.sampled_from(sorted(self.running)))
        self.q.requeue(tid, self.tick())
        self.running.discard(tid)
        self.front.append(tid)

    @precondition(lambda self: self.client_of)
    @rule(data=st.data())
    def close(self, data) -> None:
        tid = data.draw(st.sampled_from(sorted(self.client_of)))
        phase = self.q.close(tid)
        client = self.client_of[tid]
        if tid in self.running:
            assert phase is Phase.RUNNING
            self.running.discard(tid)
        elif tid in self.front:
            assert phase is Phase.QUEUED
            self.front.remove(tid)
        elif tid in self.queued[client]:
            assert phase is Phase.QUEUED
            self.queued[client].remove(tid)
        else:
            assert phase is Phase.GONE  # pushed out, or closed before

    @invariant()
    def agrees_with_the_model(self) -> None:
        waiting = sum(map(len, self.queued.values()))
        assert waiting <= self.q.max_queued  # newcomers never pass the bound; put back ones may go over it
        assert self.q.depth == waiting + len(self.front)
        assert self.q.running == len(self.running)
        order = list(self.q.order())
        assert sorted(order) == sorted([*self.front, *(t for ts in self.queued.values() for t in ts)])
        assert [self.q.ahead_of(t) for t in order] == list(range(len(order)))
        drained = copy.deepcopy(self.q)  # granting everything now follows order()
        got = []
        while (head := drained.peek()) is not None:
            drained.grant(head.id, self.now)
            got.append(head.id)
        assert got == order


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
