"""The sans-IO delivery state, driven with plain numbers for time."""

from __future__ import annotations

import random

import pytest

from swarmd.errors import LocalProtocolError
from swarmd.net.rates import StrikeCounter, TokenBucket
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


def test_backoff_grows_exponentially_up_to_the_cap_with_bounded_jitter():
    policy = RetryPolicy(initial=0.1, multiplier=2.0, maximum=1.0, jitter=0.5)
    rng = random.Random(1)
    for attempt, base in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (30, 1.0)]:
        delays = [policy.backoff(attempt, rng) for _ in range(200)]
        assert all(base * 0.5 <= d <= base for d in delays)
        assert max(delays) - min(delays) > base * 0.3  # jittered, so reconnecting peers spread out


def pending(outbox: Outbox, deadline: float = 10.0) -> Pending:
    seq = outbox.next_seq()
    p = Pending(seq, ("forward", "r", seq, 0), b"frame%d" % seq, deadline)
    outbox.add(p)
    return p


def test_outbox_numbers_frames_and_holds_at_most_a_window():
    box = Outbox(window=3)
    frames = [pending(box) for _ in range(3)]
    assert [p.seq for p in frames] == [1, 2, 3]
    assert box.full
    with pytest.raises(LocalProtocolError):
        pending(box)


def test_after_a_broken_link_every_unacked_frame_is_written_again_in_order():
    box = Outbox(window=8)
    frames = [pending(box) for _ in range(4)]
    for p in box.unsent(session=1):
        box.mark_sent(p, 1, now=0.0)
    assert list(box.unsent(session=1)) == []
    assert box.complete(2, Outcome.ACKED) is frames[1]
    newer = pending(box)
    assert [p.seq for p in box.unsent(session=2)] == [1, 3, 4, newer.seq]


def test_an_ack_settles_a_frame_once_and_late_acks_are_ignored():
    box = Outbox(window=2)
    p = pending(box)
    assert box.complete(p.seq, Outcome.ACKED) is p and p.outcome is Outcome.ACKED
    assert box.complete(p.seq, Outcome.ACKED) is None
    assert box.complete(99, Outcome.ACKED) is None
    assert len(box) == 0


def test_frames_past_their_deadline_expire():
    box = Outbox(window=4)
    early, late = pending(box, deadline=1.0), pending(box, deadline=5.0)
    assert box.next_deadline() == 1.0
    assert box.expire(now=0.5) == []
    assert box.expire(now=1.0) == [early] and early.outcome is Outcome.EXPIRED
    assert box.next_deadline() == 5.0 and len(box) == 1 and late.outcome is None


def test_unanswered_frames_get_a_ping_then_the_link_is_declared_dead():
    live = Liveness(ack_timeout=2.0, last_heard=0.0)
    assert live.check(now=1.0, oldest_unacked_sent_at=None) is Health.OK
    assert live.check(now=1.9, oldest_unacked_sent_at=0.5) is Health.OK
    assert live.next_check(1.9, 0.5) == 2.5
    assert live.check(now=2.5, oldest_unacked_sent_at=0.5) is Health.PING
    assert live.check(now=3.0, oldest_unacked_sent_at=0.5) is Health.OK  # the ping is out; wait for it
    assert live.check(now=4.5, oldest_unacked_sent_at=0.5) is Health.DEAD


def test_a_busy_receiver_answering_pings_keeps_the_link_alive():
    live = Liveness(ack_timeout=2.0, last_heard=0.0)
    assert live.check(now=2.0, oldest_unacked_sent_at=0.0) is Health.PING
    live.heard(now=2.5)  # pong: the receiver is alive, only slow to ack
    assert live.check(now=4.25, oldest_unacked_sent_at=0.0) is Health.OK
    assert live.check(now=4.5, oldest_unacked_sent_at=0.0) is Health.PING


def test_at_the_time_next_check_names_the_check_is_due_whatever_the_rounding():
    sent = 0.002  # (0.002 + 2.0) - 0.002 is just under 2.0 in floating point
    live = Liveness(ack_timeout=2.0, last_heard=0.0)
    assert live.check(now=live.next_check(1.0, sent), oldest_unacked_sent_at=sent) is Health.PING
    live = Liveness(ack_timeout=2.0, last_heard=0.0, ping_at=sent)
    assert live.check(now=live.next_check(1.0, sent), oldest_unacked_sent_at=0.0) is Health.DEAD


KEY = ("forward", "req", 3, 1)


def test_a_key_is_delivered_once_then_acked_and_replayed():
    table = DedupeTable(ttl=60, max_entries=100, max_result_bytes=1000)
    assert table.begin(KEY, now=0) == (Seen.NEW, None)
    assert table.begin(KEY, now=1) == (Seen.IN_PROGRESS, None)
    table.finish(KEY, ("reply",), nbytes=10)
    assert table.begin(KEY, now=2) == (Seen.DONE, ("reply",))
    assert table.begin(("forward", "req", 3, 2), now=2)[0] is Seen.NEW  # another hop is another key


def test_keys_are_forgotten_only_after_the_ttl():
    table = DedupeTable(ttl=60, max_entries=100, max_result_bytes=1000)
    table.begin(KEY, now=0)
    table.finish(KEY, "r", 1)
    assert table.begin(KEY, now=59.9)[0] is Seen.DONE
    assert table.begin(KEY, now=60.0)[0] is Seen.NEW
    assert len(table) == 1


def test_a_closed_request_drops_its_results_and_refuses_its_keys():
    table = DedupeTable(ttl=60, max_entries=100, max_result_bytes=1000)
    table.begin(KEY, now=0)
    table.finish(KEY, "big", nbytes=500)
    table.close("req", now=1)
    assert table.result_bytes == 0
    assert table.begin(KEY, now=2)[0] is Seen.CLOSED
    assert table.begin(("forward", "req", 4, 1), now=2)[0] is Seen.CLOSED  # a late next step too
    assert table.begin(("forward", "other", 4, 1), now=2)[0] is Seen.NEW
    assert table.begin(KEY, now=61.5)[0] is Seen.NEW


def test_results_stay_under_the_byte_budget_but_their_keys_stay_deduplicated():
    table = DedupeTable(ttl=60, max_entries=100, max_result_bytes=100)
    keys = [("forward", f"r{i}", 0, 0) for i in range(3)]
    for key in keys:
        table.begin(key, now=0)
        table.finish(key, key[1], nbytes=40)
    assert table.result_bytes <= 100
    assert table.begin(keys[0], now=1) == (Seen.DONE, None)  # oldest result dropped, key kept
    assert table.begin(keys[2], now=1) == (Seen.DONE, "r2")
    assert table.stats.results_dropped == 1


def test_a_full_table_evicts_the_oldest_entries():
    table = DedupeTable(ttl=60, max_entries=2, max_result_bytes=100)
    for i in range(3):
        table.begin(("token", f"r{i}", 0, 0), now=i)
    assert len(table) == 2 and table.stats.evicted_early == 1
    assert table.begin(("token", "r0", 0, 0), now=3)[0] is Seen.NEW


def test_strikes_cut_off_only_past_the_limit_within_the_window():
    strikes = StrikeCounter(limit=3, window=10.0)
    assert [strikes.strike(t) for t in (0, 1, 2)] == [False, False, False]
    assert strikes.strike(3) is True
    assert strikes.strike(30) is False  # the old ones are forgotten


def test_token_bucket_allows_a_burst_then_paces_at_the_rate():
    bucket = TokenBucket(rate=100.0, burst=5)
    assert [bucket.take(0.0) for _ in range(5)] == [0.0] * 5
    assert bucket.take(0.0) == pytest.approx(0.01)
    assert bucket.take(0.0) == pytest.approx(0.02)  # waiting takers queue up behind each other
    assert bucket.take(1.0) == 0.0  # refilled
