"""`swarmd join --plan FILE`: the founder's leader adopts a given plan once the peers it names have joined."""

from __future__ import annotations

import pytest

from planner import BUILTIN_ARCHS, layout_from_arch
from planner.plan import ModelRef, Plan, Stage
from swarmd.errors import UserError
from swarmd.swarm.fixed_plan import FixedPlan, PlanNotAdopted, load_plan_file
from swarmd.swarm.planning import Basis, MakePlan
from tests.swarm.swarm_helpers import descriptor, peer

LAYOUT = layout_from_arch(BUILTIN_ARCHS["smollm2-135m"], "f16")
A, B, C = sorted(peer(i) for i in range(1, 4))
PLAN = Plan(epoch=1, model=ModelRef("smollm2-135m"), stages=(Stage(A, (0, 10)), Stage(B, (10, 30))))


def action(*peers: str, epoch: int = 5) -> MakePlan:
    return MakePlan(tuple(descriptor(p) for p in peers), epoch, 2, None, Basis(frozenset(peers)))


def computed(a: MakePlan) -> Plan:
    return Plan(epoch=a.epoch, model=ModelRef("smollm2-135m"), stages=(Stage(a.nodes[0].peer_id, (0, 30)),))


def test_the_plan_waits_for_every_named_peer_then_is_adopted_under_the_new_epoch():
    fixed = FixedPlan(PLAN, LAYOUT, "plan.json")
    with pytest.raises(PlanNotAdopted, match=r"waiting for 1 of 2 peers named in plan.json to join: " + B[-6:]):
        fixed.make(action(A, C), computed)
    plan = fixed.make(action(A, B, C), computed)
    assert plan.stages == PLAN.stages and plan.epoch == 5


def test_after_adoption_the_planner_covers_for_a_missing_peer_until_it_is_back():
    fixed = FixedPlan(PLAN, LAYOUT, "plan.json")
    fixed.make(action(A, B), computed)
    assert fixed.make(action(A, epoch=6), computed).stages == (Stage(A, (0, 30)),)
    assert fixed.make(action(A, B, epoch=7), computed).stages == PLAN.stages


def test_a_plan_that_does_not_fit_the_members_memory_is_not_adopted():
    small = descriptor(B, memory=1 << 20)
    fixed = FixedPlan(PLAN, LAYOUT, "plan.json")
    with pytest.raises(PlanNotAdopted, match="does not fit the members"):
        fixed.make(MakePlan((descriptor(A), small), 5, 2, None, Basis(frozenset({A, B}))), computed)


def test_plan_files_for_another_model_or_with_gaps_are_refused_at_start(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(PLAN.dumps())
    assert load_plan_file(path, LAYOUT) == PLAN
    other = layout_from_arch(BUILTIN_ARCHS["llama-3.2-1b"], "f16")
    with pytest.raises(UserError, match=r"the plan is for model smollm2-135m, the swarm serves llama-3\.2-1b"):
        load_plan_file(path, other)
    short = Plan(epoch=1, model=ModelRef("smollm2-135m"), stages=(Stage(A, (0, 10)),))
    path.write_text(short.dumps())
    with pytest.raises(UserError, match="cover blocks 0-9 of a model with 30"):
        load_plan_file(path, LAYOUT)
    with pytest.raises(UserError, match="no such file"):
        load_plan_file(tmp_path / "missing.json", LAYOUT)
