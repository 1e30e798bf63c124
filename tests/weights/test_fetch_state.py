"""Which chunk to ask of whom (sans-IO): rarest first, never twice at once, bad senders banned, lost work redone."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.errors import LocalProtocolError
from swarmd.weights.fetch import (
    Arrived,
    ChunkState,
    Corrupt,
    FetchState,
    Offered,
    Refused,
    SourceLost,
    SourceState,
    StopSource,
    Strike,
)

SIZES = {i: 100 for i in range(6)}


def test_a_source_is_given_the_chunks_fewest_others_hold_first_and_never_one_asked_elsewhere():
    s = FetchState(SIZES)
    s.handle(Offered("A", frozenset(range(6))))
    s.handle(Offered("B", frozenset({0, 1, 2})))
    assert s.take("A", 2) == [3, 4]  # only A holds 3-5
    assert s.take("B", 2) == [0, 1]
    assert s.take("A", 4) == [5, 2]
    assert s.take("B", 4) == []  # all its chunks are asked of someone
    assert all(st is ChunkState.ASKED for st in s.state.values())


def test_arrived_chunks_complete_the_fetch():
    s = FetchState(SIZES, held=[0, 1, 2, 3])
    assert s.bytes_held == 400 and not s.done
    s.handle(Offered("A", frozenset(range(6))))
    assert s.take("A", 8) == [4, 5]
    s.handle(Arrived("A", 4))
    s.handle(Arrived("A", 5))
    assert s.done and s.bytes_held == s.bytes_total == 600


def test_a_bad_chunk_strikes_its_sender_bans_it_and_its_chunks_go_elsewhere():
    s = FetchState(SIZES)
    s.handle(Offered("A", frozenset(range(6))))
    s.handle(Offered("B", frozenset(range(6))))
    assert s.take("A", 3) == [0, 1, 2]
    actions = s.handle(Corrupt("A", 1, "hash mismatch"))
    assert actions == [Strike("A", "weights chunk 1: hash mismatch"), StopSource("A", "sent a bad chunk (hash mismatch)")]
    assert s.sources["A"] is SourceState.BANNED and s.take("A", 6) == []
    assert s.take("B", 6) == [0, 1, 2, 3, 4, 5]  # what was asked of A is wanted again
    s.handle(Offered("A", frozenset(range(6))))  # a banned source stays banned whatever it offers
    assert s.sources["A"] is SourceState.BANNED


def test_a_lost_source_gives_its_chunks_back_and_may_offer_again():
    s = FetchState(SIZES)
    s.handle(Offered("A", frozenset(range(6))))
    assert s.take("A", 2) == [0, 1]
    s.handle(SourceLost("A", "stream ended"))
    assert s.sources["A"] is SourceState.GONE and s.take("A", 1) == []
    assert s.unsourced() == [0, 1, 2, 3, 4, 5]
    s.handle(Offered("C", frozenset({0, 1})))
    assert s.take("C", 6) == [0, 1] and s.unsourced() == [2, 3, 4, 5]
    s.handle(Offered("A", frozenset(range(6))))
    assert s.take("A", 6) == [2, 3, 4, 5]


def test_a_refused_chunk_is_not_asked_of_that_source_again_until_it_offers_anew():
    s = FetchState(SIZES)
    s.handle(Offered("A", frozenset({0})))
    assert s.take("A", 1) == [0]
    s.handle(Refused("A", 0))
    assert s.take("A", 1) == [] and 0 in s.unsourced()
    s.handle(Offered("A", frozenset({0})))
    assert s.take("A", 1) == [0]


def test_answers_for_chunks_not_asked_are_our_bug():
    s = FetchState(SIZES)
    s.handle(Offered("A", frozenset(range(6))))
    s.take("A", 1)
    with pytest.raises(LocalProtocolError, match="not asked of B"):
        s.handle(Arrived("B", 0))
    s.handle(Arrived("A", 0))
    with pytest.raises(LocalProtocolError, match="not asked"):
        s.handle(Arrived("A", 0))


PEERS = ("A", "B", "C")
events = st.lists(st.one_of(
    st.tuples(st.just("offer"), st.sampled_from(PEERS), st.frozensets(st.integers(0, 5))),
    st.tuples(st.just("take"), st.sampled_from(PEERS), st.integers(0, 4)),
    st.tuples(st.sampled_from(["arrived", "corrupt", "refused"]), st.integers(0, 5), st.none()),
    st.tuples(st.just("lost"), st.sampled_from(PEERS), st.none()),
), max_size=60)


@given(events, st.frozensets(st.integers(0, 5)))
def test_any_sequence_of_events_keeps_every_promise_of_the_fetch(script, held):
    s = FetchState(SIZES, held=held)
    for kind, a, b in script:
        if kind == "offer":
            s.handle(Offered(a, b))
        elif kind == "lost":
            s.handle(SourceLost(a, "reset"))
        elif kind == "take":
            active = s.active()
            askable = {i for i, st_ in s.state.items() if st_ is ChunkState.WANTED and a in active
                       and i in s.offers.get(a, ()) and i not in s.refused.get(a, set())}
            rarity = {i: sum(1 for p in active if i in s.offers.get(p, ()) and i not in s.refused.get(p, set()))
                      for i in askable}
            got = s.take(a, b)
            assert got == sorted(askable, key=lambda i: (rarity[i], i))[:b]  # rarest first, then in file order
            assert all(s.asked_of[i] == a for i in got)
        elif a in s.asked_of:  # an answer from the source it was asked of
            peer = s.asked_of[a]
            s.handle({"arrived": Arrived(peer, a), "corrupt": Corrupt(peer, a, "bad hash"),
                      "refused": Refused(peer, a)}[kind])
        states = s.state.values()
        assert {i for i, st_ in s.state.items() if st_ is ChunkState.ASKED} == set(s.asked_of)
        assert s.bytes_held == sum(SIZES[i] for i, st_ in s.state.items() if st_ is ChunkState.HELD)
        assert s.done == all(st_ is ChunkState.HELD for st_ in states)
        assert s.unsourced() == sorted(i for i, st_ in s.state.items() if st_ is ChunkState.WANTED and not any(
            i in s.offers.get(p, ()) and i not in s.refused.get(p, set()) for p in s.active()))
