"""The peer gate decides who may talk to a daemon: the allowlist, strikes, floods and penalties."""

from __future__ import annotations

from swarmd.net.gate import GuardLimits, PeerGate

LIMITS = GuardLimits(bad_frames=3, bad_frames_window=10.0, penalty=30.0, flood_drops=5, flood_window=1.0)


def gate(**kw) -> tuple[PeerGate, list[tuple[str, str]]]:
    cut: list[tuple[str, str]] = []
    return PeerGate(limits=LIMITS, self_id="me", on_penalised=lambda p, r: cut.append((p, r)), **kw), cut


def test_only_peers_on_the_allowlist_are_admitted_and_self_always_is():
    g, _ = gate(allow=frozenset({"a"}))
    assert g.admits("a", 0.0) and g.admits("me", 0.0)
    assert g.refusal("b", 0.0) == "not on the allowlist"
    assert PeerGate().admits("anyone", 0.0)


def test_more_bad_frames_than_the_limit_within_the_window_cut_a_peer_off_for_the_penalty():
    g, cut = gate()
    assert not any(g.strike("a", t, "bad") for t in (0.0, 1.0, 2.0))
    assert g.strike("a", 3.0, "bad frame 4") and [p for p, _ in cut] == ["a"] and "bad frame 4" in cut[0][1]
    assert "penalised for 30 s" in g.refusal("a", 3.0)
    assert g.admits("b", 3.0)  # others carry on
    assert not g.strike("a", 4.0, "more") and len(cut) == 1  # once in the box, not again
    assert g.expire(32.9) == [] and g.expire(33.0) == ["a"] and g.admits("a", 33.0)


def test_strikes_spread_wider_than_the_window_are_forgiven():
    g, cut = gate()
    assert not any(g.strike("a", t, "bad") for t in (0.0, 8.0, 16.0, 24.0, 32.0))
    assert cut == []


def test_a_peer_over_its_rate_is_refused_and_a_sustained_flood_is_penalised():
    g, cut = gate()
    taken = [g.within_rate("a", "gossip", 0.0, rate=10.0, burst=3) for _ in range(5)]
    assert taken == [True, True, True, False, False] and cut == []
    assert g.within_rate("a", "gossip", 0.1, rate=10.0, burst=3)  # refilled at its rate
    assert not any(g.within_rate("a", "gossip", 0.1, rate=10.0, burst=3) for _ in range(4))
    assert [p for p, _ in cut] == ["a"] and "flood" in cut[0][1]
    assert g.within_rate("me", "gossip", 0.1, rate=10.0, burst=3)


def test_records_of_quiet_peers_are_dropped_so_memory_stays_bounded():
    g, _ = gate()
    for i in range(1000):
        g.within_rate(f"p{i}", "gossip", 0.0, rate=1.0, burst=1)
    g.strike("noisy", 50.0, "bad")
    g.expire(55.0)
    assert set(g._peers) == {"noisy"}
