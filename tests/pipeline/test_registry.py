"""Actor names to peers from a Plan, and whether the plan's chain can serve a request yet."""

from __future__ import annotations

from planner.plan import ModelRef, Plan, Stage
from swarmd.inference.registry import EMPTY, Registry, chain_status

PLAN = Plan(7, ModelRef("m"), (Stage("A", (0, 10), ("stage-0",)), Stage("B", (10, 20), ("stage-1", "moe-router-12")),
                               Stage("C", (20, 30))))


def member(peer: str, layers, state: str = "ready", alive: str = "alive", error: str = "") -> dict:
    return {"peer_id": peer, "state": alive,
            "assignment": {"layers": list(layers) if layers else None, "state": state, "error": error}}


def test_each_stage_actor_lives_on_its_plan_peer():
    r = Registry.from_plan(PLAN)
    assert r.epoch == 7 and r.n_stages == 3
    assert [r.peer_of(f"stage-{i}") for i in range(3)] == ["A", "B", "C"]
    assert r.peer_of("moe-router-12") == "B" and r.peer_of("stage-9") is None
    assert (r.hop_of("B"), r.hop_of("Z")) == (1, None)
    assert (r.next_peer(0), r.next_peer(2)) == ("B", None)
    assert r.layers == ((0, 10), (10, 20), (20, 30))


def test_each_expert_actor_lives_on_its_nearest_holder():
    plan = Plan(7, PLAN.model, PLAN.stages, experts={12: {0: ("C",), 1: ("A", "B")}})
    r = Registry.from_plan(plan)
    assert (r.peer_of("moe-expert-12-0"), r.peer_of("moe-expert-12-1"), r.peer_of("moe-expert-12-2")) == ("C", "A", None)


def test_no_plan_is_an_empty_registry():
    assert Registry.from_plan(None) is EMPTY and EMPTY.n_stages == 0


def test_the_chain_is_ready_when_every_stage_is_alive_and_loaded():
    members = [member("A", (0, 10)), member("B", (10, 20)), member("C", (20, 30))]
    status = chain_status(PLAN.to_json(), members)
    assert status.ready and status.detail == "plan epoch 7: 3 stages ready"


def test_the_chain_says_what_it_waits_for():
    plan = PLAN.to_json()
    assert chain_status(None, []).detail.startswith("no plan yet")
    loading = chain_status(plan, [member("A", (0, 10)), member("B", (10, 20), "loading"), member("C", (0, 10))])
    assert not loading.ready
    assert "loading stage 1 (blocks 10-19" in loading.detail and "stage 2 (blocks 20-29" in loading.detail
    gone = chain_status(plan, [member("A", (0, 10)), member("B", (10, 20), alive="dead")])
    assert not gone.ready and "waiting for a new plan" in gone.detail and "stage 2" in gone.detail
    failed = chain_status(plan, [member("A", (0, 10)), member("B", (10, 20), "failed", error="out of memory"),
                                 member("C", (20, 30))])
    assert not failed.ready and "out of memory" in failed.detail
