"""check_plan_against, fleet specs, hot experts and the re-plan after a loss, by example."""

from __future__ import annotations

import pytest

from planner import BUILTIN_ARCHS, MoESpec, PlanOptions, PlanSchemaError, layout_from_arch, make_plan
from planner.check import check_plan_against, missing_peers
from planner.fleet import GPU_PROFILES, make_fleet, parse_fleet, profile
from tests.planner.planner_strategies import GiB, node, toy_layout

PLAIN = PlanOptions(runtime_overhead_bytes=0)


def test_a_plan_checks_clean_against_its_own_nodes():
    layout = toy_layout(4)
    nodes = [node("a", 8), node("b", 8)]
    assert check_plan_against(make_plan(layout, nodes, options=PLAIN), layout, nodes, PLAIN) == []


def test_missing_peers_are_told_apart_from_problems_waiting_cannot_fix():
    layout = toy_layout(4)
    plan = make_plan(layout, [node("a", 8), node("b", 8)], options=PLAIN)
    problems = check_plan_against(plan, layout, [node("a", 8)], PLAIN)
    assert problems == ["peer b (stage 1) has not joined"]
    assert missing_peers(problems)
    small = check_plan_against(plan, layout, [node("a", 1), node("b", 8)], PLAIN)
    assert small == ["peer a needs 2.0 GiB for its assignment, has 1.0 GiB free"]
    assert not missing_peers(small)


def test_a_plan_for_another_model_or_with_holes_is_refused():
    layout = toy_layout(4)
    plan = make_plan(layout, [node("a", 8), node("b", 8)], options=PLAIN)
    other = toy_layout(6, name="other")
    problems = check_plan_against(plan, other, [node("a", 8), node("b", 8)], PLAIN)
    assert "the plan is for model toy, the swarm serves other" in problems
    assert any("cover blocks 0-3 of a model with 6" in p for p in problems)


def test_moe_plans_need_every_expert_held():
    moe = MoESpec(n_experts=4, top_k=2, bytes_per_expert=2**20, flops_per_expert_token=1)
    layout = toy_layout(2, moe=moe)
    nodes = [node("a", 8), node("b", 8)]
    plan = make_plan(layout, nodes, options=PLAIN)
    del plan.experts[1][3]
    assert check_plan_against(plan, layout, nodes, PLAIN) == ["block 1: 1 expert(s) without a holder (3)"]


def test_fleet_spec_expands_counts_and_spreads_regions_round_robin():
    assert [(c, p.key) for c, p in parse_fleet("40x4090, 8X3090,3060")] == [(40, "4090"), (8, "3090"), (1, "3060")]
    assert profile("RTX 4060 Ti 16GB").key == "4060ti" and profile("m2-ultra").key == "m2ultra"
    nodes = make_fleet("2x4090,2x3060", regions=2, rtt_ms=(2.0, 80.0), uplink_mbit=100)
    assert [n.peer_id for n in nodes] == ["r0-4090-0", "r1-4090-1", "r0-3060-2", "r1-3060-3"]
    first = nodes[0]
    assert first.rtt_ms == {"r1-4090-1": 80.0, "r0-3060-2": 2.0, "r1-3060-3": 80.0}
    assert first.uplink_bps == 100e6
    assert first.memory_free == 24 * GiB - GiB // 2
    with pytest.raises(PlanSchemaError, match="unknown GPU"):
        parse_fleet("3xH100")


def test_every_required_gpu_has_a_profile_with_a_source():
    assert set(GPU_PROFILES) >= {"3060", "3090", "4060ti", "4090", "5090", "a4000", "m2ultra"}
    assert all(p.source and p.peak_bandwidth > 0 and p.peak_flops > 0 for p in GPU_PROFILES.values())


def test_hot_experts_get_replicas_near_their_stage():
    moe = MoESpec(n_experts=8, top_k=2, bytes_per_expert=GiB // 8, flops_per_expert_token=10**8)
    layout = toy_layout(1, block_bytes=GiB // 8, moe=moe)
    nodes = [node(p, 1.5, rtt={q: 2.0 for q in "abcd" if q != p}) for p in "abcd"]
    load = (30.0, 1, 1, 1, 1, 1, 1, 1)  # expert 0: 30/37 of the tokens, 6.5x the mean: 1 + 6.5 // 2 copies
    opts = PlanOptions(runtime_overhead_bytes=0, expert_load={0: load})
    plan = make_plan(layout, nodes, options=opts)
    assert len(plan.experts[0][0]) == opts.max_replicas
    assert all(len(plan.experts[0][x]) == 1 for x in range(1, 8))
    uniform = make_plan(layout, nodes, options=PLAIN)
    assert all(len(h) == 1 for h in uniform.experts[0].values())


def test_losing_a_node_keeps_the_others_within_tolerance_and_re_plans_beyond_it():
    layout = toy_layout(9)
    nodes = [node(p, 16) for p in "abc"]
    before = make_plan(layout, nodes, options=PLAIN)
    assert [s.layers for s in before.stages] == [(0, 3), (3, 6), (6, 9)]
    survivors = [n for n in nodes if n.peer_id != "a"]
    # Keeping b and c means b takes a's blocks too: 6 blocks against the best split's 5 (+20 %).
    lenient = PlanOptions(runtime_overhead_bytes=0, replan_tolerance=0.25)
    kept = make_plan(layout, survivors, options=lenient, previous=before)
    assert [(s.peer_id, s.layers) for s in kept.stages] == [("b", (0, 6)), ("c", (6, 9))]
    assert any("kept surviving nodes' assignments" in r for r in kept.reasons)
    moved = make_plan(layout, survivors, options=PLAIN, previous=before)
    assert sorted(s.layers[1] - s.layers[0] for s in moved.stages) == [4, 5]
    assert any("moved assignments: keeping them costs 20%" in r for r in moved.reasons)


def test_kimi_k2_on_a_lan_fleet_is_feasible_and_keeps_experts_with_their_stages():
    layout = layout_from_arch(BUILTIN_ARCHS["kimi-k2"], "int4")
    nodes = make_fleet("40x4090,8x3090,4x3060")
    plan = make_plan(layout, nodes, policy="min-latency")
    assert plan.predicted.stream_tokens_per_s > 5
    assert all(plan.experts[b][x] == (plan.stages[plan.stage_of_block(b)].peer_id,)
               for b in plan.experts for x in plan.experts[b])
