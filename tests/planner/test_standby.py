"""Spare nodes: kept out of the chain, given a copy of a stage, and put exactly in a lost stage's place."""

from __future__ import annotations

from dataclasses import replace

from planner import Plan, make_plan
from planner.memory import stage_bytes
from planner.options import PlanOptions
from planner.report import node_rows
from planner.standby import choose_standbys
from tests.planner.planner_strategies import node, toy_layout

LAYOUT = toy_layout(12, ends_bytes=2**28)  # the first and last stage carry the embedding and the head


def spare(peer: str, mem_gib: float) -> object:
    return replace(node(peer, mem_gib), standby=True)


def ranges(plan: Plan) -> dict[str, tuple[int, int]]:
    return {s.peer_id: s.layers for s in plan.stages}


def test_a_spare_runs_no_stage_and_holds_a_copy_of_the_largest_stage():
    plan = make_plan(LAYOUT, [node("a", 16), node("b", 16), node("c", 16), spare("s", 16)])
    assert "s" not in ranges(plan) and len(plan.stages) == 3
    sizes = [stage_bytes(LAYOUT, *s.layers, PlanOptions()) for s in plan.stages]
    largest = plan.stages[sizes.index(max(sizes))]  # the first of the largest
    assert plan.standbys == {"s": largest.layers}
    assert any(r.startswith("standby s copies blocks") for r in plan.reasons)


def test_a_lost_stage_goes_to_the_spare_holding_its_copy_and_the_survivors_keep_their_blocks():
    nodes = [node("a", 16), node("b", 16), node("c", 16), spare("s", 16)]
    before = make_plan(LAYOUT, nodes, epoch=1)
    [lost] = [s for s in before.stages if s.layers == before.standbys["s"]]
    after = make_plan(LAYOUT, [n for n in nodes if n.peer_id != lost.peer_id], epoch=2, previous=before)
    expected = {p: layers for p, layers in ranges(before).items() if p != lost.peer_id} | {"s": lost.layers}
    assert ranges(after) == expected  # nothing moved: the spare had the blocks, the others keep theirs
    assert after.standbys == {}
    assert any("taken over by the standby holding a copy (s)" in r for r in after.reasons)


def test_a_spare_without_the_lost_range_takes_it_as_a_newcomer_and_the_survivors_keep_their_blocks():
    nodes = [node("a", 16), node("b", 16), node("c", 16), spare("s", 16)]
    before = make_plan(LAYOUT, nodes, epoch=1)
    lost = next(s for s in before.stages if s.layers != before.standbys["s"])
    after = make_plan(LAYOUT, [n for n in nodes if n.peer_id != lost.peer_id], epoch=2, previous=before)
    assert ranges(after) == {p: layers for p, layers in ranges(before).items() if p != lost.peer_id} | {"s": lost.layers}


def test_a_spare_keeps_its_copy_when_the_plan_is_kept():
    nodes = [node("a", 16), node("b", 16), node("c", 16), spare("s", 16)]
    before = make_plan(LAYOUT, nodes, epoch=1)
    # the spare's memory now holds its copy: the planner counts it back
    held = replace(nodes[3], memory_free=nodes[3].memory_free - 5 * 2**30)
    again = make_plan(LAYOUT, [*nodes[:3], held], epoch=2, previous=before)
    assert ranges(again) == ranges(before) and again.standbys == before.standbys
    assert any(r.startswith("standby s keeps its copy") for r in again.reasons)


def test_spares_run_stages_when_the_others_cannot_hold_the_model():
    plan = make_plan(LAYOUT, [node("a", 5), node("b", 5), spare("s", 8)])
    assert "s" in ranges(plan) and plan.standbys == {}
    assert plan.reasons[0] == "standby nodes run stages: the other nodes cannot hold the model"


def test_two_spares_copy_two_different_stages_and_a_spare_too_small_holds_none():
    stages = [("a", (0, 4)), ("b", (4, 8)), ("c", (8, 12))]
    copies, reasons = choose_standbys(LAYOUT, [spare("s1", 16), spare("s2", 16), spare("tiny", 1)], stages,
                                      {"a", "b", "c"}, PlanOptions())
    assert copies["s1"] != copies["s2"] and "tiny" not in copies
    assert "standby tiny holds no copy: no stage's blocks fit its memory" in reasons


def test_standbys_survive_the_json_round_trip():
    plan = make_plan(LAYOUT, [node("a", 16), node("b", 16), spare("s", 16)])
    assert Plan.loads(plan.dumps()) == plan and plan.standbys


def test_the_plan_report_shows_a_spare_with_the_blocks_it_holds():
    nodes = [node("a", 16), node("b", 16), spare("s", 16)]
    plan = make_plan(LAYOUT, nodes)
    [row] = [r for r in node_rows(plan, LAYOUT, nodes) if r.peer_id == "s"]
    assert (row.role, row.blocks) == ("standby", plan.standbys["s"]) and row.memory_used > 0
