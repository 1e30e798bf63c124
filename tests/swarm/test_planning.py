"""Which plan counts: the leader's debounced planning and the members' acceptance rules."""

from __future__ import annotations

from planner.plan import ModelRef, Plan, Stage
from swarmd.config import LAN
from swarmd.swarm.planning import (
    Announced,
    Candidates,
    EpochSeen,
    Leadership,
    MakePlan,
    PlanAccepted,
    PlanCoordinator,
    PlanFailed,
    PlanMade,
    PlanRejected,
    PublishPlan,
)
from swarmd.wire.gossip import PlanAnnouncement
from tests.swarm.swarm_helpers import descriptor, peer

ME, A, B = sorted(peer(i) for i in range(1, 4))


def plan(epoch: int, *peers: str) -> Plan:
    n = len(peers)
    stages = tuple(Stage(p, (i * 30 // n, (i + 1) * 30 // n)) for i, p in enumerate(peers))
    return Plan(epoch=epoch, model=ModelRef("smollm2-135m"), stages=stages)


def leader_with(*peers: str) -> PlanCoordinator:
    c = PlanCoordinator(ME, LAN)
    c.handle(Leadership(1, ME), now=0.0)
    c.handle(Candidates(tuple(descriptor(p) for p in peers)), now=0.0)
    return c


def run_planner(c: PlanCoordinator, action: MakePlan, now: float):
    return c.handle(PlanMade(plan(action.epoch, *[n.peer_id for n in action.nodes]), action.basis, action.term), now)


def test_the_leader_plans_once_membership_has_been_quiet_for_the_debounce_time():
    c = leader_with(ME, A)
    assert c.tick(now=LAN.replan_debounce / 2) == []
    [make] = c.tick(now=LAN.replan_debounce)
    assert isinstance(make, MakePlan) and make.epoch == 1 and [n.peer_id for n in make.nodes] == [ME, A]
    out = run_planner(c, make, now=LAN.replan_debounce)
    assert [type(a) for a in out] == [PlanAccepted, PublishPlan]
    assert c.tick(now=LAN.replan_debounce + 0.1) == []


def test_a_membership_change_re_plans_with_a_higher_epoch_but_a_load_change_does_not():
    c = leader_with(ME, A)
    run_planner(c, c.tick(now=2.0)[0], now=2.0)
    busy = descriptor(A).__class__(**{**descriptor(A).__dict__, "load": 7.0})
    c.handle(Candidates((descriptor(ME), busy)), now=3.0)
    assert [a for a in c.tick(now=5.0) if isinstance(a, MakePlan)] == []
    c.handle(Candidates((descriptor(ME), descriptor(A), descriptor(B))), now=6.0)
    [make] = c.tick(now=6.0 + LAN.replan_debounce)
    assert make.epoch == 2 and make.previous is not None and make.previous.epoch == 1


def test_the_leader_repeats_its_plan_for_late_joiners():
    c = leader_with(ME)
    run_planner(c, c.tick(now=2.0)[0], now=2.0)
    assert c.tick(now=2.0 + LAN.plan_republish_interval) == [PublishPlan(c.current)]


def test_a_new_leader_plans_above_every_epoch_it_has_seen():
    c = PlanCoordinator(ME, LAN)
    c.handle(Leadership(4, A), now=0.0)
    c.handle(Announced(PlanAnnouncement(A, 4, plan(9, A, ME))), now=0.0)
    c.handle(EpochSeen(11), now=0.0)
    c.handle(Candidates((descriptor(ME), descriptor(B))), now=0.0)
    c.handle(Leadership(5, ME), now=1.0)
    [make] = c.tick(now=1.0 + LAN.replan_debounce)
    assert make.epoch == 12 and make.term == 5


def reasons(actions) -> list[str]:
    return [a.reason for a in actions if isinstance(a, PlanRejected)]


def test_members_accept_only_the_current_leaders_newer_plan():
    c = PlanCoordinator(B, LAN)
    c.handle(Leadership(2, A), now=0.0)
    assert reasons(c.handle(Announced(PlanAnnouncement(ME, 2, plan(5, ME))), now=0.0)) == ["not_leader"]
    assert reasons(c.handle(Announced(PlanAnnouncement(A, 1, plan(6, A))), now=0.0)) == ["stale"]
    [acc] = c.handle(Announced(PlanAnnouncement(A, 2, plan(3, A, B))), now=0.0)
    assert isinstance(acc, PlanAccepted) and c.epoch == 3
    assert c.handle(Announced(PlanAnnouncement(A, 2, plan(3, A, B))), now=0.1) == []  # a republish
    assert reasons(c.handle(Announced(PlanAnnouncement(A, 2, plan(2, A))), now=0.1)) == ["stale"]
    assert reasons(c.handle(Announced(PlanAnnouncement(A, 2, plan(3, A))), now=0.1)) == ["conflicting"]
    assert c.epoch == 3 and c.current.plan == plan(3, A, B)


def test_a_plan_that_arrives_before_its_leader_is_known_is_accepted_when_the_election_agrees():
    c = PlanCoordinator(B, LAN)
    assert c.handle(Announced(PlanAnnouncement(A, 3, plan(4, A, B))), now=0.0) == []
    [acc] = c.handle(Leadership(3, A), now=0.1)
    assert isinstance(acc, PlanAccepted) and c.epoch == 4


def test_an_infeasible_plan_is_reported_once_and_retried_only_when_membership_changes():
    c = leader_with(ME, A)
    make = c.tick(now=2.0)[0]
    out = c.handle(PlanFailed("needs 3.0 GiB more memory", make.basis, make.term), now=2.0)
    assert [a.reason for a in out] == ["needs 3.0 GiB more memory"]
    assert c.tick(now=5.0) == []
    c.handle(Candidates((descriptor(ME), descriptor(A), descriptor(B))), now=6.0)
    assert isinstance(c.tick(now=6.0 + LAN.replan_debounce)[0], MakePlan)


def test_a_member_whose_load_failed_is_left_out_until_it_restarts():
    c = leader_with(ME, A)
    run_planner(c, c.tick(now=2.0)[0], now=2.0)
    c.handle(Candidates((descriptor(ME), descriptor(A)), frozenset({(A, 1)})), now=3.0)
    [make] = c.tick(now=3.0 + LAN.replan_debounce)
    assert [n.peer_id for n in make.nodes] == [ME]
    run_planner(c, make, now=4.5)
    c.handle(Candidates((descriptor(ME), descriptor(A, incarnation=2))), now=5.0)
    [make] = c.tick(now=5.0 + LAN.replan_debounce)
    assert [n.peer_id for n in make.nodes] == [ME, A]


def test_a_member_that_gains_memory_to_give_is_planned_for_though_no_one_joined():
    c = leader_with(ME, A)
    full = descriptor(A).__class__(**{**descriptor(A).__dict__, "memory_free": 0})
    c.handle(Candidates((descriptor(ME), full)), now=1.0)
    run_planner(c, c.tick(now=3.0)[0], now=3.0)
    c.handle(Candidates((descriptor(ME), full)), now=4.0)
    assert [a for a in c.tick(now=6.0) if isinstance(a, MakePlan)] == []  # nothing changed
    c.handle(Candidates((descriptor(ME), descriptor(A))), now=7.0)  # its memory came free: it is ready now
    [make] = c.tick(now=7.0 + LAN.replan_debounce)
    assert make.epoch == 2 and [n.peer_id for n in make.nodes] == [ME, A]
