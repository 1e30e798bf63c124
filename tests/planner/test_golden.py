"""Small cases worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from planner import InfeasiblePlan, MoESpec, PlanOptions, make_plan
from planner.policies import Planner, sorted_nodes
from tests.planner.planner_strategies import GiB, node, toy_layout

# No KV, no overhead, free network: only compute and memory decide.
PLAIN = PlanOptions(runtime_overhead_bytes=0, hop_overhead_ms=0.0, default_rtt_ms=0.0)


def layers(plan):
    return [(s.peer_id, s.layers) for s in plan.stages]


def test_two_equal_nodes_split_four_blocks_in_half():
    plan = make_plan(toy_layout(4), [node("b", 8), node("a", 8)], options=PLAIN)
    assert layers(plan) == [("a", (0, 2)), ("b", (2, 4))]


def test_a_node_twice_as_fast_takes_twice_the_blocks():
    # 6 blocks of 1 GFLOP: a (1 TFLOP/s) takes 2 (2 ms), b (2 TFLOP/s) takes 4 (2 ms).
    plan = make_plan(toy_layout(6), [node("a", 8, flops=1e12), node("b", 8, flops=2e12)], options=PLAIN)
    assert layers(plan) == [("a", (0, 2)), ("b", (2, 6))]
    assert plan.predicted.token_latency_ms == pytest.approx(4.0, rel=1e-4)
    assert plan.predicted.saturated_tokens_per_s == pytest.approx(500.0, rel=1e-4)


def test_memory_caps_a_fast_node():
    # b is 10x faster but holds only 2 blocks of 1 GiB; a must take the other 4.
    plan = make_plan(toy_layout(6), [node("a", 8, flops=1e12), node("b", 2, flops=1e13)], options=PLAIN)
    assert layers(plan) == [("a", (0, 4)), ("b", (4, 6))]


def test_min_latency_leaves_out_a_slow_node_behind_a_long_hop():
    fast = node("a", 8, flops=1e12, rtt={"b": 40.0})
    slow = node("b", 8, flops=1e11, rtt={"a": 40.0})
    opts = PlanOptions(runtime_overhead_bytes=0, hop_overhead_ms=0.0)
    plan = make_plan(toy_layout(4), [fast, slow], policy="min-latency", options=opts)
    assert layers(plan) == [("a", (0, 4))]
    assert plan.predicted.token_latency_ms == pytest.approx(4.0, rel=1e-4)
    # balanced still gives b a stage, one block: 1 + 40/2 ... the chain is a: 3 ms, b: 10 ms.
    balanced = make_plan(toy_layout(4), [fast, slow], options=opts)
    assert layers(balanced) == [("a", (0, 3)), ("b", (3, 4))]


def test_chain_follows_the_rtt_tour_not_the_peer_ids():
    # Four nodes on a line at 0, 10, 1 and 11 ms: in id order the loop is 10+9+10+11 = 40 ms of
    # RTT; the best loops (a c b d, a c d b, ...) are 22 ms.
    pos = {"a": 0.0, "b": 10.0, "c": 1.0, "d": 11.0}
    nodes = [node(p, 8, rtt={q: abs(pos[p] - pos[q]) for q in pos if q != p}) for p in pos]
    opts = PlanOptions(runtime_overhead_bytes=0, group_rtt_ms=0.5)
    chain = [s.peer_id for s in make_plan(toy_layout(4), nodes, options=opts).stages]
    assert len(chain) == 4
    loop = sum(abs(pos[chain[i]] - pos[chain[(i + 1) % 4]]) for i in range(4))
    assert loop == 22.0


def test_expected_fanout_matches_the_hand_count():
    # 4 experts, top-2; experts 0,1 on the stage (free), 2,3 on r at 10 ms.
    # P(neither 2 nor 3 picked) = C(2,2)/C(4,2) = 1/6, so E[max] = 10 x 5/6.
    moe = MoESpec(n_experts=4, top_k=2, bytes_per_expert=1, flops_per_expert_token=0)
    lay = toy_layout(1, block_bytes=1, block_flops=0, moe=moe)
    nodes = sorted_nodes([node("s", 8, rtt={"r": 10.0}), node("r", 8, rtt={"s": 10.0})])
    p = Planner(lay, nodes, PlanOptions(runtime_overhead_bytes=0, hop_overhead_ms=0.0), "balanced")
    s, r = p.index["s"], p.index["r"]
    latency, sends, runs = p.cm.expected_fanout(0, s, [(s,), (s,), (r,), (r,)])
    assert latency == pytest.approx(10 * 5 / 6, rel=1e-3)  # the activation itself costs ~nothing here
    assert sends == pytest.approx(5 / 6)
    assert np.allclose(runs[[s, r]], [1.0, 1.0])  # each node runs one of the two picks on average


def test_small_moe_keeps_experts_with_their_stage_when_memory_allows():
    moe = MoESpec(n_experts=4, top_k=2, bytes_per_expert=GiB // 4, flops_per_expert_token=10**8)
    lay = toy_layout(2, moe=moe)
    plan = make_plan(lay, [node("a", 8, rtt={"b": 20.0}), node("b", 8, rtt={"a": 20.0})], options=PLAIN)
    assert layers(plan) == [("a", (0, 1)), ("b", (1, 2))]
    assert plan.experts == {0: {e: ("a",) for e in range(4)}, 1: {e: ("b",) for e in range(4)}}
    assert plan.stages[0].actors == ("stage-0", "moe-router-0")


def test_not_enough_memory_says_how_much_and_for_which_blocks():
    with pytest.raises(InfeasiblePlan) as err:
        make_plan(toy_layout(6), [node("a", 2), node("b", 2.5)], options=PLAIN)
    assert str(err.value) == "needs 1.5 GiB more memory for blocks 4-5"


def test_a_block_larger_than_every_node_is_named():
    with pytest.raises(InfeasiblePlan, match=r"needs 1\.0 GiB more memory for block 0 \(on one node"):
        make_plan(toy_layout(2, block_bytes=3 * GiB), [node("a", 2), node("b", 2)], options=PLAIN)


def test_experts_that_do_not_fit_are_named():
    moe = MoESpec(n_experts=8, top_k=2, bytes_per_expert=GiB, flops_per_expert_token=1)
    with pytest.raises(InfeasiblePlan, match=r"needs .* GiB more memory for blocks"):
        make_plan(toy_layout(2, moe=moe), [node("a", 6), node("b", 6)], options=PLAIN)


def test_expert_placement_can_be_forced():
    # Three equal nodes, one MoE block of 6 experts: spread gives each node 2, the stage's own first.
    moe = MoESpec(n_experts=6, top_k=2, bytes_per_expert=GiB // 4, flops_per_expert_token=10**8)
    lay = toy_layout(3, moe=moe, moe_from=2)
    nodes = [node(p, 8, rtt={q: 1.0 for q in "abc" if q != p}) for p in "abc"]
    spread = make_plan(lay, nodes, options=PlanOptions(runtime_overhead_bytes=0, expert_placement="spread"))
    assert "experts spread over each stage's group" in spread.reasons[0]
    assert sorted(h for hs in spread.experts[2].values() for h in hs) == ["a", "a", "b", "b", "c", "c"]
    local = make_plan(lay, nodes, options=PlanOptions(runtime_overhead_bytes=0, expert_placement="local"))
    assert "experts with their stage" in local.reasons[0]
    assert set(local.experts[2].values()) == {(local.stages[-1].peer_id,)}
