"""When hole punching is tried, and again: every transition of `PunchBook` on a fake clock."""

from __future__ import annotations

from swarmd.net.hole_punch import TRANSITIONS, PunchBook, PunchEvent, PunchState


def test_the_lower_peer_id_tries_first_and_the_other_side_later():
    low, high = PunchBook("12D3KooWA"), PunchBook("12D3KooWZ")
    low.relayed_only("12D3KooWZ", 0.0)
    high.relayed_only("12D3KooWA", 0.0)
    assert low.due(1.0) == ["12D3KooWZ"] and high.due(1.0) == []
    assert high.due(3.0) == ["12D3KooWA"]


def test_failures_back_off_doubling_up_to_the_cap_and_a_success_resets_the_schedule():
    book = PunchBook("A", initial_delay=0.0, first_backoff=5.0, max_backoff=20.0)
    book.relayed_only("B", 0.0)
    now, waits = 0.0, []
    for _ in range(4):
        assert book.due(now) == ["B"]
        book.result("B", False, now, "no direct connection came up")
        punch = book.punches["B"]
        assert punch.state is PunchState.WAITING and book.due(now) == []
        waits.append(punch.next_at - now)
        now = punch.next_at
    assert waits == [5.0, 10.0, 20.0, 20.0]
    assert book.punches["B"].failures == 4 and book.punches["B"].last_error
    book.due(now)
    book.result("B", True, now + 1.2)
    punch = book.punches["B"]
    assert punch.state is PunchState.DIRECT and punch.attempts == 0 and punch.took_s == 1.2


def test_a_direct_connection_however_it_came_ends_the_attempts_and_losing_it_starts_them_again():
    book = PunchBook("A", initial_delay=1.0)
    book.relayed_only("B", 0.0)
    book.direct("B", 0.5)
    punch = book.punches["B"]
    assert punch.state is PunchState.DIRECT and punch.successes == 1 and punch.took_s == 0.5
    assert book.due(100.0) == []
    book.relayed_only("B", 200.0)
    assert book.punches["B"].state is PunchState.WAITING and book.due(201.0) == ["B"]
    book.forget("B")
    assert book.due(300.0) == []


def test_every_transition_is_in_the_table_and_nothing_else_moves():
    book = PunchBook("A")
    book.relayed_only("B", 0.0)
    book.result("B", True, 0.0)  # not punching: ignored
    assert book.punches["B"].state is PunchState.WAITING
    assert set(TRANSITIONS.values()) <= set(PunchState)
    assert (PunchState.DIRECT, PunchEvent.DUE) not in TRANSITIONS
