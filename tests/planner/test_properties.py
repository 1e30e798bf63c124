"""Properties every plan keeps, over generated layouts and fleets (a few seconds per suite)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from planner import InfeasiblePlan, Plan, PlanOptions, make_plan
from planner.memory import node_memory_use, stage_need_matrix
from planner.plan import validate_chain
from tests.planner.planner_strategies import fleets, layouts

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OPTS = PlanOptions(runtime_overhead_bytes=64 * 2**20, context_length=256, concurrency=2)
policies = st.sampled_from(["balanced", "min-latency"])


def plan_or_skip(layout, nodes, **kw):
    try:
        return make_plan(layout, nodes, options=OPTS, **kw)
    except InfeasiblePlan as e:
        assert "\n" not in str(e) and str(e).startswith(("needs ", "no node"))
        assume(False)


@SETTINGS
@given(layouts(), fleets(), policies)
def test_every_block_once_in_order_every_expert_somewhere_no_node_over_memory(layout, nodes, policy):
    plan = plan_or_skip(layout, nodes, policy=policy)
    validate_chain(plan, layout.n_blocks)
    peers = {n.peer_id: n for n in nodes}
    assert all(s.peer_id in peers for s in plan.stages)
    assert set(plan.experts) == set(layout.moe_blocks())
    for block, by_expert in plan.experts.items():
        assert sorted(by_expert) == list(range(layout.blocks[block].moe.n_experts))
        assert all(holders and set(holders) <= set(peers) for holders in by_expert.values())
        assert all(len(set(h)) == len(h) for h in by_expert.values())
    use = node_memory_use(layout, [(s.peer_id, s.layers) for s in plan.stages], plan.experts, OPTS)
    for peer, need in use.items():
        assert need <= peers[peer].memory_free, f"{peer} needs {need} of {peers[peer].memory_free}"


@SETTINGS
@given(layouts(), fleets(), policies, st.randoms(use_true_random=False))
def test_permuting_the_nodes_gives_the_same_plan(layout, nodes, policy, rnd):
    plan = plan_or_skip(layout, nodes, policy=policy)
    shuffled = list(nodes)
    rnd.shuffle(shuffled)
    assert make_plan(layout, shuffled, policy=policy, options=OPTS).to_json() == plan.to_json()


@SETTINGS
@given(layouts(), fleets(), policies)
def test_json_round_trip_is_the_identity(layout, nodes, policy):
    plan = plan_or_skip(layout, nodes, policy=policy, epoch=7)
    again = Plan.loads(plan.dumps())
    assert again == plan
    assert again.dumps() == plan.dumps()


@SETTINGS
@given(layouts(), fleets(max_nodes=5), fleets(min_nodes=1, max_nodes=1), policies)
def test_adding_a_node_never_makes_the_prediction_worse(layout, nodes, extra, policy):
    newcomer = extra[0]
    assume(newcomer.peer_id not in {n.peer_id for n in nodes})
    before = plan_or_skip(layout, nodes, policy=policy)
    after = make_plan(layout, [*nodes, newcomer], policy=policy, options=OPTS, previous=before)
    if policy == "min-latency":
        assert after.predicted.token_latency_ms <= before.predicted.token_latency_ms * (1 + 1e-5)
    else:
        assert after.predicted.saturated_tokens_per_s >= before.predicted.saturated_tokens_per_s * (1 - 1e-5)


@SETTINGS
@given(layouts(), fleets(min_nodes=2), policies, st.integers(0, 5))
def test_replan_after_losing_a_node_keeps_the_others_when_tolerance_allows(layout, nodes, policy, pick):
    before = plan_or_skip(layout, nodes, policy=policy)
    lost = before.stages[pick % len(before.stages)].peer_id
    survivors = [n for n in nodes if n.peer_id != lost]
    lenient = PlanOptions(**{**OPTS.__dict__, "replan_tolerance": 1e9})
    try:
        after = make_plan(layout, survivors, policy=policy, options=lenient, previous=before)
    except InfeasiblePlan:
        assume(False)
    event("kept" if any("kept surviving" in r for r in after.reasons) else "moved")
    if not any("kept surviving" in r for r in after.reasons):
        # Only when the survivors cannot absorb the lost node's part in memory.
        assert not any("kept" in r for r in after.reasons)
        return
    old = {s.peer_id: s.layers for s in before.stages}
    for s in after.stages:
        if s.peer_id in old:
            a, b = old[s.peer_id]
            assert s.layers[0] <= a and b <= s.layers[1], f"{s.peer_id} lost blocks"
    for peer in {p for p in before.peers() if p != lost}:
        held = before.experts_on(peer)
        now = after.experts_on(peer)
        assert all(set(xs) <= set(now.get(b, [])) for b, xs in held.items())


@SETTINGS
@given(layouts(), fleets(max_nodes=8, rtts=[1.0]))
def test_balanced_uses_every_ready_node(layout, nodes):
    """A node is ready for a stage when it can hold one block; with more nodes than blocks, the
    rest hold experts (when there are at least as many experts as nodes). With experts to spread, a ready
    node may hold experts instead of a stage when that plan is better."""
    plan = plan_or_skip(layout, nodes)
    need = stage_need_matrix(layout, OPTS)
    smallest = min(need[b, b + 1] for b in range(layout.n_blocks)) + OPTS.runtime_overhead_bytes
    ready = sorted(n.peer_id for n in nodes if n.memory_free >= smallest)
    staged = sorted(s.peer_id for s in plan.stages)
    if len(ready) <= layout.n_blocks:
        working = set(plan.peers()) if any("others holding experts" in r for r in plan.reasons) else set(staged)
        assert set(ready) <= working or any("not every node could hold a stage" in r for r in plan.reasons)
        event("every node a stage" if staged == ready else "a stage or experts for each node that could")
    else:
        n_experts = sum(layout.blocks[b].moe.n_experts for b in layout.moe_blocks())
        if n_experts >= len(nodes) - len(staged):
            assert set(plan.peers()) == {n.peer_id for n in nodes}
            event("stages and experts on every node")


def test_local_swarms_of_two_to_six_daemons_get_one_stage_each():
    from planner import BUILTIN_ARCHS, NodeDescriptor, layout_from_arch

    rnd = random.Random(4)
    layout = layout_from_arch(BUILTIN_ARCHS["smollm2-135m"], "f32")
    for n in range(2, 7):
        # Daemons on one machine: CPU speed measured with noise, RTT 0-2 ms in whole ms.
        ids = [f"12D3KooW{rnd.getrandbits(40):010x}" for _ in range(n)]
        nodes = [NodeDescriptor(peer_id=p, memory_total=2 * 2**30, memory_free=2 * 2**30,
                                flops=rnd.uniform(0.7, 1.3) * 5e10, mem_bandwidth=rnd.uniform(0.7, 1.3) * 1e10,
                                rtt_ms={q: float(rnd.randint(0, 2)) for q in ids if q != p}) for p in ids]
        plan = make_plan(layout, nodes)
        assert len(plan.stages) == n
        assert sorted(s.peer_id for s in plan.stages) == sorted(ids)
