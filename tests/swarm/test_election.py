"""Leader election as a state machine: claims and member changes in, leader changes out."""

from __future__ import annotations

from swarmd.swarm.election import Claim, Election, LeaderChanged, MembersChanged, new_term, term_round
from tests.swarm.swarm_helpers import peer

P = sorted(peer(i) for i in range(1, 6))  # P[0] has the lowest peer id


def members(e: Election, live, dead=(), admitted=True):
    return e.handle(MembersChanged(frozenset(live), frozenset(dead), admitted), now=0.0)


def test_a_lone_founder_leads_on_the_first_round():
    e = Election(P[3])
    assert members(e, {P[3]}) == [LeaderChanged(new_term(0, P[3]), P[3], "elected lowest live peer id (no leader yet)")]
    assert e.is_leader and term_round(e.term) == 1


def test_a_term_names_its_leader_and_rounds_order_terms():
    assert new_term(0, P[0]) != new_term(0, P[1])
    assert term_round(new_term(0, P[0])) == term_round(new_term(0, P[1])) == 1
    assert new_term(new_term(0, P[4]), P[0]) > new_term(0, P[4])


def test_nobody_leads_before_admission():
    e = Election(P[0])
    assert members(e, {P[0], P[1]}, admitted=False) == []
    assert e.leader is None


def test_a_joiner_adopts_the_incumbent_even_if_its_own_id_is_lower():
    e = Election(P[0])
    e.handle(Claim(P[2], term=3, leader=P[4]), now=0.0)
    out = members(e, {P[0], P[2], P[4]})
    assert [(c.term, c.leader) for c in out] == [(3, P[4])]


def test_a_claim_for_a_leader_not_yet_heard_from_is_still_adopted():
    e = Election(P[0])
    e.handle(Claim(P[2], term=3, leader=P[4]), now=0.0)
    members(e, {P[0], P[2]})
    assert (e.term, e.leader) == (3, P[4])


def test_the_incumbent_stays_while_alive_when_a_lower_id_joins():
    e = Election(P[2])
    members(e, {P[2]})
    assert members(e, {P[0], P[2]}) == []
    assert e.leader == P[2]


def test_a_dead_leader_is_replaced_by_the_lowest_live_peer_on_a_higher_term():
    e = Election(P[3])
    e.handle(Claim(P[1], term=4, leader=P[1]), now=0.0)
    members(e, {P[1], P[2], P[3]})
    out = members(e, {P[2], P[3]}, dead={P[1]})
    assert [(c.term, c.leader) for c in out] == [(new_term(4, P[2]), P[2])]


def test_every_survivor_picks_the_same_new_leader_and_term():
    nodes = {p: Election(p) for p in P}
    for e in nodes.values():
        e.handle(Claim(P[0], term=2, leader=P[0]), now=0.0)
        members(e, set(P))
    survivors = [e for p, e in nodes.items() if p != P[0]]
    for e in survivors:
        members(e, set(P[1:]), dead={P[0]})
    assert {(e.term, e.leader) for e in survivors} == {(new_term(2, P[1]), P[1])}


def test_split_brains_elect_on_different_terms_then_converge_on_the_higher_one():
    left, right = Election(P[0]), Election(P[3])
    members(left, {P[0], P[1]})
    members(right, {P[3], P[4]})
    assert term_round(left.term) == term_round(right.term) == 1 and left.term != right.term  # one leader a term
    # the partition heals: each hears the other's claim
    left.handle(Claim(P[3], right.term, right.leader), now=1.0)
    right.handle(Claim(P[0], left.term, left.leader), now=1.0)
    members(left, set(P) - {P[2]})
    members(right, set(P) - {P[2]})
    winner = max((new_term(0, P[0]), P[0]), (new_term(0, P[3]), P[3]))
    assert (left.term, left.leader) == (right.term, right.leader) == winner
    later = new_term(winner[0], P[4])  # a later round wins, whoever leads it
    right.handle(Claim(P[1], term=later, leader=P[4]), now=2.0)
    left.handle(Claim(P[1], term=later, leader=P[4]), now=2.0)
    assert left.leader == right.leader == P[4]


def test_a_claim_naming_a_dead_leader_is_ignored_but_its_term_counts():
    e = Election(P[3])
    members(e, {P[2], P[3]}, dead={P[0]})
    assert (e.term, e.leader) == (new_term(0, P[2]), P[2])
    later = new_term(new_term(new_term(0, P[1]), P[1]), P[0])  # a term of round 3
    assert e.handle(Claim(P[2], term=later, leader=P[0]), now=0.0) == []
    assert (e.term, e.leader) == (new_term(0, P[2]), P[2])
    [change] = members(e, {P[3]}, dead={P[0], P[2]})
    assert (change.term, change.leader) == (new_term(later, P[3]), P[3]) and term_round(change.term) == 4
