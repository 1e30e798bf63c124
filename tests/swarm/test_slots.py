"""A plan file's slots: the leader binds each to the daemon claiming it, refuses a second claim, and adopts the
plan with their peer ids once every slot it uses is claimed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from swarm_helpers import descriptor, peer

from planner import BUILTIN_ARCHS, layout_from_arch
from planner.plan import ModelRef, Plan, Stage
from planner.plan_file import PlanFile, fleet_of
from swarmd.errors import UserError
from swarmd.swarm.fixed_plan import FixedPlan, PlanNotAdopted, load_plan_file
from swarmd.swarm.planning import Basis, MakePlan
from swarmd.swarm.slots import bind_slots

LAYOUT = layout_from_arch(BUILTIN_ARCHS["smollm2-135m"], "f16")
A, B, C, D = sorted(peer(i) for i in range(1, 5))
FLEET = fleet_of(["gpu-0", "gpu-1", "spare"], ["RTX 4090", "RTX 3060 12GB", "RTX 3060 12GB"],
                 [24 << 30, 12 << 30, 12 << 30], [0, 1, 1], [[1.0, 40.0], [40.0, 1.0]], 100.0)
FILE = PlanFile(Plan(epoch=0, model=ModelRef("smollm2-135m"), stages=(Stage("gpu-0", (0, 10)),
                                                                     Stage("gpu-1", (10, 30)))), FLEET)


def claim(peer_id: str, slot: str):
    return replace(descriptor(peer_id), slot=slot)


def action(*nodes, epoch: int = 5, previous: Plan | None = None) -> MakePlan:
    return MakePlan(tuple(nodes), epoch, 2, previous, Basis(frozenset(n.peer_id for n in nodes)))


def computed(a: MakePlan) -> Plan:
    return Plan(epoch=a.epoch, model=ModelRef("smollm2-135m"), stages=(Stage(a.nodes[0].peer_id, (0, 30)),))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_held_slot_stays_with_its_daemon_and_a_free_one_goes_to_the_lowest_peer_id():
    nodes = [claim(D, "gpu-0"), claim(B, "gpu-0"), claim(C, "gpu-1"), descriptor(A)]
    fresh = bind_slots(FLEET.names, nodes, {})
    assert fresh.peers == {"gpu-0": B, "gpu-1": C} and fresh.refused == {D: "gpu-0"}
    assert fresh.unclaimed == ("spare",)
    kept = bind_slots(FLEET.names, nodes, {"gpu-0": D})
    assert kept.peers["gpu-0"] == D and kept.refused == {B: "gpu-0"}
    gone = bind_slots(FLEET.names, [claim(B, "gpu-0")], {"gpu-0": D})  # its holder is no longer live
    assert gone.peers == {"gpu-0": B} and not gone.refused
    assert bind_slots(FLEET.names, [claim(A, "gpu-7")], {}).unknown == {A: "gpu-7"}


def test_the_leader_waits_for_the_slots_the_plan_uses_then_adopts_it_with_their_peer_ids():
    fixed = FixedPlan(FILE, LAYOUT, "moe.json")
    with pytest.raises(PlanNotAdopted, match=r"waiting for 1 of 2 slots of moe\.json to be claimed: gpu-1"):
        fixed.make(action(claim(A, "gpu-0")), computed)
    plan = fixed.make(action(claim(A, "gpu-0"), claim(B, "gpu-1")), computed)  # "spare" holds nothing: not waited for
    assert [(s.peer_id, s.layers) for s in plan.stages] == [(A, (0, 10)), (B, (10, 30))] and plan.epoch == 5
    assert fixed.status("gpu-0")["bound"] == {"gpu-0": A, "gpu-1": B, "spare": None}


def test_a_second_claim_of_a_slot_is_refused_and_the_first_keeps_it():
    fixed = FixedPlan(FILE, LAYOUT, "moe.json")
    with pytest.raises(PlanNotAdopted):
        fixed.make(action(claim(C, "gpu-0")), computed)
    plan = fixed.make(action(claim(C, "gpu-0"), claim(A, "gpu-0"), claim(B, "gpu-1")), computed)
    assert plan.stages[0].peer_id == C  # A sorts first, but C claimed first
    assert fixed.status("gpu-1")["refused"] == {A: "gpu-0"}


def test_slots_unclaimed_past_the_claim_timeout_are_named():
    clock = Clock()
    fixed = FixedPlan(FILE, LAYOUT, "moe.json", claim_timeout=120.0, clock=clock)
    with pytest.raises(PlanNotAdopted):
        fixed.make(action(claim(A, "gpu-0")), computed)
    clock.now = 119.0
    assert fixed.overdue() == []
    clock.now = 121.0
    assert fixed.overdue() == ["gpu-1", "spare"] and fixed.status("gpu-0")["overdue"] == ["gpu-1", "spare"]


def test_a_new_leader_starts_from_the_bindings_it_was_told_and_keeps_a_running_swarm_going():
    fixed = FixedPlan(FILE, LAYOUT, "moe.json")
    fixed.learn({"gpu-0": D, "gpu-1": B, "elsewhere": C})
    assert fixed.held == {"gpu-0": D, "gpu-1": B}
    plan = fixed.make(action(claim(A, "gpu-0"), claim(D, "gpu-0"), claim(B, "gpu-1")), computed)
    assert plan.stages[0].peer_id == D
    # gpu-1's daemon is gone while the swarm ran its plan: the planner covers for it
    running = fixed.make(action(claim(D, "gpu-0"), epoch=6, previous=plan), computed)
    assert running.stages == (Stage(D, (0, 30)),)


def test_a_slot_the_file_lacks_or_a_file_without_slots_is_one_line_at_start(tmp_path):
    path = tmp_path / "moe.json"
    path.write_text(FILE.dumps())
    assert load_plan_file(path, LAYOUT, "gpu-1") == FILE
    with pytest.raises(UserError, match=r"--slot gpu-9: moe\.json has no such slot; its slots are gpu-0, gpu-1, spare"):
        load_plan_file(path, LAYOUT, "gpu-9")
    path.write_text(FILE.plan.dumps())
    with pytest.raises(UserError, match="--slot needs a plan file with a fleet"):
        load_plan_file(path, LAYOUT, "gpu-1")


def test_a_plan_file_for_other_weights_of_the_model_is_refused(tmp_path):
    path = tmp_path / "moe.json"
    path.write_text(PlanFile(replace(FILE.plan, model=ModelRef("smollm2-135m", "ab" * 32)), FLEET).dumps())
    with pytest.raises(UserError, match=r"the plan is for other weights of smollm2-135m \(digest abababababab"):
        load_plan_file(path, replace(LAYOUT, digest="cd" * 32), "gpu-0")
