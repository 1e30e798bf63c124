"""Membership as a state machine, driven by hand with a fake clock."""

from __future__ import annotations

from swarmd.config import LAN
from swarmd.swarm.membership import (
    Admitted,
    ConnectionLost,
    Dial,
    Forgotten,
    HeartbeatReceived,
    LeaveReceived,
    Membership,
    Probe,
    ProbeResult,
    Reconnect,
    Refused,
    RefusedMessage,
    State,
    StateChanged,
)
from tests.swarm.swarm_helpers import descriptor, heartbeat, peer

ME, A, B = peer(1), peer(2), peer(3)


def founder() -> Membership:
    return Membership(local=descriptor(ME), timings=LAN, founder=True)


def joiner() -> Membership:
    return Membership(local=descriptor(ME), timings=LAN, founder=False)


def changes(actions) -> list[tuple[str, State | None, State]]:
    return [(a.peer_id, a.old, a.new) for a in actions if isinstance(a, StateChanged)]


def test_a_compatible_heartbeat_makes_an_alive_member_and_asks_to_dial_it():
    m = founder()
    out = m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    assert changes(out) == [(A, None, State.ALIVE)]
    assert Dial(A, descriptor(A).addresses) in out
    assert m.live() == {ME, A}


def test_silence_makes_a_member_suspect_and_a_failed_probe_makes_it_dead():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    quiet = m.tick(now=LAN.suspect_after - 0.1)
    assert changes(quiet) == []
    out = m.tick(now=LAN.suspect_after + 0.1)
    assert changes(out) == [(A, State.ALIVE, State.SUSPECT)]
    assert Probe(A) in quiet + out  # the routine probe, or one sent now
    out = m.handle(ProbeResult(A, ok=False, error="connection refused"), now=LAN.suspect_after + 0.2)
    assert changes(out) == [(A, State.SUSPECT, State.DEAD)]
    assert m.live() == {ME}


def test_a_suspect_that_answers_its_probe_is_alive_again():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.tick(now=LAN.suspect_after + 0.1)
    out = m.handle(ProbeResult(A, ok=True, rtt_ms=1.5), now=LAN.suspect_after + 0.2)
    assert changes(out) == [(A, State.SUSPECT, State.ALIVE)]
    assert m.members[A].rtt_ms == 1.5


def answering_probes_only(m: Membership, peer_id: str, start: float, until: float) -> list:
    """Ticks every quarter second from `start` to `until`; `peer_id` answers every probe at once and sends no
    heartbeat. Every action in that time."""
    out, now = [], start
    while now < until:
        now += 0.25
        for a in m.tick(now=now):
            out.append(a)
            if isinstance(a, Probe):
                out += m.handle(ProbeResult(a.peer_id, ok=True, rtt_ms=1.0), now=now)
    return out


def test_a_member_that_answers_its_probes_is_alive_without_heartbeats():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    out = answering_probes_only(m, A, 0.0, 5 * LAN.suspect_after)
    assert changes(out) == []
    assert m.state_of(A) == State.ALIVE


def test_a_member_answering_probes_but_silent_on_gossip_is_reconnected_once_per_gossip_timeout():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    timeout = LAN.gossip_timeout(2)
    before = answering_probes_only(m, A, 0.0, timeout - 0.25)
    assert not [a for a in before if isinstance(a, Reconnect)]  # a heartbeat may just be late
    after = answering_probes_only(m, A, timeout - 0.25, 2 * timeout - 0.25)
    assert [a.peer_id for a in after if isinstance(a, Reconnect)] == [A]  # its gossip stream is broken
    assert changes(before + after) == []


def test_heartbeats_between_probes_mean_gossip_works_and_nothing_reconnects():
    m = founder()
    out = []
    for i in range(1, 40):
        now = i * LAN.heartbeat_interval
        out += m.handle(HeartbeatReceived(heartbeat(A, i)), now=now)
        out += answering_probes_only(m, A, now, now + LAN.heartbeat_interval - 0.01)
    assert not [a for a in out if isinstance(a, Reconnect)]
    assert changes(out) == [(A, None, State.ALIVE)]


def test_swarms_larger_than_eight_heartbeat_and_probe_less_often_so_each_member_handles_as_many_messages():
    assert [LAN.heartbeat_period(n) for n in (1, 4, 8)] == [LAN.refresh_interval] * 3
    assert [LAN.probe_period(n) for n in (1, 4, 8)] == [LAN.probe_interval] * 3
    for n in (9, 16, 52, 400):
        assert n / LAN.heartbeat_period(n) == 8 / LAN.refresh_interval
        assert n / LAN.probe_period(n) == 8 / LAN.probe_interval
    assert LAN.suspicion_timeout(52) > 2 * LAN.probe_period(52)  # as many probes missed as in small swarms


def test_heartbeats_refresh_far_apart_while_probes_keep_liveness_and_a_broken_gossip_stream_waits_three_refreshes():
    for n in (2, 4, 8, 52):
        assert LAN.heartbeat_period(n) > LAN.suspicion_timeout(n) > LAN.probe_period(n)
        assert LAN.gossip_timeout(n) == 3 * LAN.heartbeat_period(n)


def test_a_member_of_a_large_swarm_is_alive_on_rare_heartbeats_and_its_probes():
    m = founder()
    for i in range(40):
        m.handle(HeartbeatReceived(heartbeat(peer(10 + i), 1)), now=0.0)
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    period = LAN.heartbeat_period(len(m.live()))  # 42 members: a heartbeat every 5.25 refresh intervals
    assert period == 42 / 8 * LAN.refresh_interval
    out = []
    for i in range(1, 11):
        out += answering_probes_only(m, A, (i - 1) * period, i * period)
        out += m.handle(HeartbeatReceived(heartbeat(A, 1 + i)), now=i * period)
    assert changes(out) == []  # never suspect: not A, nor the 40 that only answer probes
    assert not [a for a in out if isinstance(a, Reconnect) and a.peer_id == A]


def test_a_heartbeat_clears_suspicion():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.tick(now=LAN.suspect_after + 0.1)
    out = m.handle(HeartbeatReceived(heartbeat(A, 2)), now=LAN.suspect_after + 0.2)
    assert changes(out) == [(A, State.SUSPECT, State.ALIVE)]


def test_regular_heartbeats_never_raise_suspicion():
    m = founder()
    suspicions = []
    for i in range(1, 200):
        now = i * LAN.heartbeat_interval
        m.handle(HeartbeatReceived(heartbeat(A, i)), now=now)
        for a in m.tick(now + 0.5):
            if isinstance(a, Probe):
                m.handle(ProbeResult(A, ok=True, rtt_ms=1.0), now=now + 0.5)
            suspicions += [a for a in changes([a]) if a[2] != State.ALIVE]
    assert suspicions == []


def test_a_lost_connection_raises_suspicion_at_once_and_probes():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    out = m.handle(ConnectionLost(A), now=0.1)
    assert changes(out) == [(A, State.ALIVE, State.SUSPECT)]
    assert Probe(A) in out


def test_an_unanswered_suspect_dies_after_another_timeout_even_without_a_probe_result():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.handle(ConnectionLost(A), now=0.0)
    assert changes(m.tick(now=LAN.suspect_after + 0.1)) == [(A, State.SUSPECT, State.DEAD)]


def test_stale_and_duplicate_heartbeats_change_nothing():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 5)), now=0.0)
    m.tick(now=LAN.suspect_after + 0.1)
    assert m.handle(HeartbeatReceived(heartbeat(A, 5)), now=LAN.suspect_after + 0.2) == []
    assert m.handle(HeartbeatReceived(heartbeat(A, 4)), now=LAN.suspect_after + 0.2) == []
    assert m.state_of(A) == State.SUSPECT


def test_a_lost_connection_whose_probes_fail_is_dead_after_a_suspicion_timeout_not_at_the_first_probe():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.handle(ConnectionLost(A), now=0.0)
    assert m.handle(ProbeResult(A, ok=False), now=0.1) == []  # a reset link is being dialled again
    assert m.state_of(A) == State.SUSPECT
    assert Probe(A) in m.tick(now=0.5)
    out = m.handle(ProbeResult(A, ok=True, rtt_ms=1.0), now=0.6)
    assert changes(out) == [(A, State.SUSPECT, State.ALIVE)]
    m.handle(ConnectionLost(A), now=1.0)
    m.handle(ProbeResult(A, ok=False), now=1.1)
    assert changes(m.tick(now=1.0 + LAN.suspect_after + 0.1)) == [(A, State.SUSPECT, State.DEAD)]


def test_a_dead_member_comes_back_only_when_a_probe_confirms_its_newer_heartbeat():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.tick(now=LAN.suspect_after + 0.1)
    m.handle(ProbeResult(A, ok=False), now=LAN.suspect_after + 0.2)
    assert m.state_of(A) == State.DEAD
    out = m.handle(HeartbeatReceived(heartbeat(A, 2)), now=LAN.suspect_after + 1.0)
    assert out == [Probe(A)] and m.state_of(A) == State.DEAD
    out = m.handle(ProbeResult(A, ok=True, rtt_ms=1.0), now=LAN.suspect_after + 1.1)
    assert changes(out) == [(A, State.DEAD, State.ALIVE)]


def test_a_restart_with_a_higher_incarnation_rejoins_at_once():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 50)), now=0.0)
    m.handle(LeaveReceived(A, incarnation=1), now=1.0)
    assert m.state_of(A) == State.DEAD
    out = m.handle(HeartbeatReceived(heartbeat(A, 1, incarnation=2)), now=2.0)
    assert changes(out) == [(A, State.DEAD, State.ALIVE)]
    assert m.members[A].incarnation == 2


def test_leave_makes_a_member_dead_at_once_and_its_old_heartbeats_do_not_revive_it():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    out = m.handle(LeaveReceived(A, incarnation=1), now=0.5)
    assert changes(out) == [(A, State.ALIVE, State.DEAD)]
    assert m.handle(HeartbeatReceived(heartbeat(A, 2)), now=0.6) == []


def test_dead_members_are_forgotten_after_the_retention_time():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.handle(LeaveReceived(A, incarnation=1), now=0.0)
    assert Forgotten(A) in m.tick(now=LAN.dead_retention + 1)
    assert A not in m.members


def test_members_of_another_model_or_wire_version_are_refused_with_a_reason():
    m = founder()
    out = m.handle(HeartbeatReceived(heartbeat(A, 1, model="llama-3.2-1b")), now=0.0)
    assert out == [Refused(A, "serves model 'llama-3.2-1b', this swarm serves 'smollm2-135m'")]
    assert m.handle(HeartbeatReceived(heartbeat(B, 1, wire=99)), now=0.0)[0].reason.startswith("speaks wire version 99")
    assert m.live() == {ME}
    assert m.handle(RefusedMessage(A, "serves model 'llama-3.2-1b', this swarm serves 'smollm2-135m'"), 0.1) == []


def test_a_refused_peer_that_restarts_compatible_becomes_a_member():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1, model="other")), now=0.0)
    m.handle(HeartbeatReceived(heartbeat(A, 1, incarnation=2)), now=1.0)
    assert m.state_of(A) == State.ALIVE and A not in m.refused


def test_a_joiner_is_admitted_only_when_an_admitted_member_names_it():
    m = joiner()
    assert not m.admitted
    m.handle(HeartbeatReceived(heartbeat(A, 1, view=(A,))), now=0.0)
    m.handle(HeartbeatReceived(heartbeat(B, 1, view=(B, ME), admitted=False)), now=0.0)
    assert not m.admitted
    out = m.handle(HeartbeatReceived(heartbeat(A, 2, view=(A, ME))), now=1.0)
    assert Admitted(A) in out and m.admitted


def test_a_failed_routine_probe_of_a_member_that_still_heartbeats_changes_nothing():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    out = m.tick(now=LAN.probe_interval)
    assert out == [Probe(A)]
    assert m.handle(ProbeResult(A, ok=False, error="timed out"), now=LAN.probe_interval + 1) == []
    assert m.state_of(A) == State.ALIVE and m.members[A].reason == "joined"


def test_suspicion_timeout_grows_with_the_log_of_the_swarm_size_and_as_its_heartbeats_spread():
    assert LAN.suspicion_timeout(4) == LAN.suspicion_timeout(8) == LAN.suspect_after
    assert LAN.suspicion_timeout(100) == 2 * LAN.suspect_after * LAN.heartbeat_period(100) / LAN.refresh_interval
