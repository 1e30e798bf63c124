"""Membership under random event sequences: every state change is a row of the transition table, is announced
(so the daemon's view is membership's), and silence ends in every member forgotten. An illegal transition
raises LocalProtocolError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.config import LAN
from swarmd.errors import LocalProtocolError
from swarmd.swarm.membership import (
    TRANSITIONS,
    Admitted,
    Cause,
    ConnectionLost,
    Forgotten,
    HeartbeatReceived,
    LeaveReceived,
    Membership,
    Probe,
    ProbeResult,
    RefusedMessage,
    State,
    StateChanged,
)
from tests.swarm.swarm_helpers import descriptor, heartbeat, peer

ME = peer(1)
PEERS = (peer(2), peer(3), peer(4))

peers = st.sampled_from(PEERS)
events = st.one_of(
    st.tuples(st.just("heartbeat"), peers, st.integers(-1, 3), st.integers(0, 1), st.booleans(),
              st.sampled_from(["compatible"] * 6 + ["other model"])),
    st.tuples(st.just("leave"), peers, st.integers(-1, 1)),
    st.tuples(st.just("probe"), peers, st.booleans(), st.booleans()),
    st.tuples(st.just("lost"), peers),
    st.tuples(st.just("refused message"), peers),
    st.tuples(st.just("tick"), st.floats(0.0, 2 * LAN.suspect_after + LAN.dead_retention / 4)),
)


class Driver:
    """Feeds membership, keeping what each peer last sent and the view its actions announce."""

    def __init__(self, founder: bool) -> None:
        self.m = Membership(local=descriptor(ME), timings=LAN, founder=founder)
        self.now = 0.0
        self.seq = dict.fromkeys(PEERS, 0)
        self.incarnation = dict.fromkeys(PEERS, 1)
        self.announced: dict[str, State] = {}  # what StateChanged and Forgotten said, per peer
        self.was_admitted = self.m.admitted

    def step(self, event: tuple) -> None:
        kind, *args = event
        if kind == "heartbeat":
            p, seq_step, restart, names_me, model = args
            self.incarnation[p] += restart
            self.seq[p] = 1 if restart else max(0, self.seq[p] + seq_step)
            hb = heartbeat(p, self.seq[p], incarnation=self.incarnation[p], view=(p, ME) if names_me else (p,),
                           model="smollm2-135m" if model == "compatible" else "other")
            self.apply(self.m.handle(HeartbeatReceived(hb), self.now))
        elif kind == "leave":
            p, offset = args
            self.apply(self.m.handle(LeaveReceived(p, self.incarnation[p] + offset), self.now))
        elif kind == "probe":
            p, ok, refused = args
            self.apply(self.m.handle(ProbeResult(p, ok=ok, rtt_ms=1.0 if ok else None, refused=refused), self.now))
        elif kind == "lost":
            self.apply(self.m.handle(ConnectionLost(args[0]), self.now))
        elif kind == "refused message":
            self.apply(self.m.handle(RefusedMessage(args[0], "speaks wire version 0"), self.now))
        else:
            self.now += args[0]
            self.apply(self.m.tick(self.now))
        self.check()

    def apply(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, StateChanged):
                assert a.old == self.announced.get(a.peer_id), (a, self.announced)
                assert any(TRANSITIONS.get((a.old, c), "no") in (a.new, None) for c in Cause), a
                self.announced[a.peer_id] = a.new
            elif isinstance(a, Forgotten):
                assert self.announced.pop(a.peer_id) == State.DEAD
            elif isinstance(a, Admitted):
                assert self.m.admitted

    def check(self) -> None:
        m = self.m
        for p in PEERS:
            member = m.members.get(p)
            if member is not None:
                assert self.announced[p] == member.state and member.since <= self.now
                assert not member.left or member.state == State.DEAD
                assert not member.connection_lost or member.state == State.SUSPECT
            else:
                assert self.announced.get(p) in (None, State.DEAD)
                self.announced.pop(p, None)
        assert m.live() == {ME} | {p for p, x in m.members.items() if x.state != State.DEAD}
        assert m.admitted or not self.was_admitted  # once admitted, always admitted
        self.was_admitted = m.admitted

    def fall_silent(self) -> None:
        """No heartbeat from anyone and every probe fails: after long enough, nobody is left."""
        for _ in range(6):
            self.now += 2 * LAN.suspicion_timeout(len(PEERS) + 1) + LAN.dead_retention
            for action in self.m.tick(self.now):
                self.apply([action])
                if isinstance(action, Probe):
                    self.apply(self.m.handle(ProbeResult(action.peer_id, ok=False, error="timed out"), self.now))
            self.check()


@settings(max_examples=300, deadline=None)
@given(st.booleans(), st.lists(events, max_size=60))
def test_every_state_change_is_a_row_of_the_table_and_is_announced(founder, sequence):
    d = Driver(founder)
    for event in sequence:
        d.step(event)
    d.fall_silent()
    assert d.m.members == {} and d.announced == {}


def test_an_illegal_transition_raises_a_local_protocol_error():
    d = Driver(founder=True)
    d.step(("heartbeat", PEERS[0], 1, 0, True, "compatible"))
    member = d.m.members[PEERS[0]]
    with pytest.raises(LocalProtocolError, match="suspicion expired in state alive"):
        d.m._fire(member, Cause.SUSPICION_EXPIRED, d.now, "no")
    with pytest.raises(LocalProtocolError, match="forgotten in state alive"):
        d.m._fire(member, Cause.FORGOTTEN, d.now, "no")
    assert member.state == State.ALIVE


def test_the_table_has_a_way_out_of_every_state_and_only_joining_enters():
    assert {new for (old, _), new in TRANSITIONS.items() if old is None} == {State.ALIVE}
    for state in State:
        assert {new for (old, _), new in TRANSITIONS.items() if old == state} - {state}
