"""The simulator against hand counts, and how it responds to load, batching and links."""

from __future__ import annotations

import pytest

from planner import MoESpec, Plan, PlanOptions, make_plan
from planner.plan import ModelRef, Stage
from planner.simulate import SimConfig, simulate
from tests.planner.planner_strategies import GiB, node, toy_layout

PLAIN = PlanOptions(runtime_overhead_bytes=0)


def two_stage_plan(n_blocks: int = 4) -> Plan:
    half = n_blocks // 2
    return Plan(epoch=0, model=ModelRef("toy"), stages=(Stage("a", (0, half)), Stage("b", (half, n_blocks))))


def test_one_stream_decode_time_is_the_hand_count():
    # 4 blocks of 1 GFLOP on 1 TFLOP/s nodes: 4 ms of compute. Hop a->b: 5 ms (half of 10) + 1 ms
    # overhead + 1024 B at 1 Gbit/s (0.008192 ms); the token back b->a: 6 ms + 8 B (0.000064 ms).
    nodes = [node("a", 8, uplink=1e9, rtt={"b": 10.0}), node("b", 8, uplink=1e9, rtt={"a": 10.0})]
    result = simulate(two_stage_plan(), toy_layout(4), nodes, SimConfig(streams=1, prompt_tokens=1, decode_tokens=8))
    assert result.token_latency_ms == pytest.approx(4 + 6.008192 + 6.000064)
    assert result.stream_tokens_per_s == pytest.approx(1e3 / (4 + 6.008192 + 6.000064))
    assert result.breakdown_ms["hops"] == pytest.approx(12.008256)
    assert result.breakdown_ms["queue"] == 0.0


def test_a_link_model_replaces_the_descriptor_network():
    class Slow:
        def transfer_ms(self, src: str, dst: str, nbytes: int) -> float:
            return 0.0

        def latency_ms(self, src: str, dst: str) -> float:
            return 50.0

    nodes = [node("a", 8), node("b", 8)]
    result = simulate(two_stage_plan(), toy_layout(4), nodes, SimConfig(streams=1, prompt_tokens=1, decode_tokens=4),
                      link=Slow())
    assert result.token_latency_ms == pytest.approx(4 + 2 * 50.0)


def test_concurrent_streams_queue_without_batching_and_share_weights_with_it():
    # Memory-bound blocks: 1 GiB of weights at 100 GB/s is ~10.7 ms a block, FLOPs are negligible.
    nodes = [node("a", 8, bw=1e11), node("b", 8, bw=1e11)]
    layout = toy_layout(4, block_flops=1)
    one = simulate(two_stage_plan(), layout, nodes, SimConfig(streams=1, prompt_tokens=1, decode_tokens=8))
    queued = simulate(two_stage_plan(), layout, nodes,
                      SimConfig(streams=8, prompt_tokens=1, decode_tokens=8, batching=False))
    batched = simulate(two_stage_plan(), layout, nodes, SimConfig(streams=8, prompt_tokens=1, decode_tokens=8))
    # Without batching two stages serve at most 2 tokens per 4 block-times.
    assert queued.aggregate_tokens_per_s <= 2 * one.stream_tokens_per_s * 1.01
    assert queued.breakdown_ms["queue"] > 0
    assert batched.aggregate_tokens_per_s > 2 * queued.aggregate_tokens_per_s
    assert batched.mean_batch > 2


def test_remote_experts_cost_a_round_trip_per_moe_block():
    moe = MoESpec(n_experts=8, top_k=2, bytes_per_expert=GiB // 16, flops_per_expert_token=1)
    layout = toy_layout(2, block_flops=1, moe=moe)
    nodes = [node("a", 8, rtt={"b": 20.0}), node("b", 8, rtt={"a": 20.0})]
    local = Plan(epoch=0, model=ModelRef("toy"), stages=(Stage("a", (0, 2)),),
                 experts={b: {x: ("a",) for x in range(8)} for b in (0, 1)})
    remote = Plan(epoch=0, model=ModelRef("toy"), stages=(Stage("a", (0, 2)),),
                  experts={b: {x: ("b",) for x in range(8)} for b in (0, 1)})
    cfg = SimConfig(streams=1, prompt_tokens=1, decode_tokens=6)
    near, far = simulate(local, layout, nodes, cfg), simulate(remote, layout, nodes, cfg)
    # Each MoE block adds one 20 ms round trip plus two 1 ms message overheads.
    assert far.token_latency_ms - near.token_latency_ms == pytest.approx(2 * 22.0, abs=0.1)


def test_speculative_rounds_yield_more_than_one_token():
    nodes = [node("a", 8, rtt={"b": 40.0}), node("b", 8, rtt={"a": 40.0})]
    plain = simulate(two_stage_plan(), toy_layout(4), nodes, SimConfig(streams=1, prompt_tokens=1, decode_tokens=40))
    spec = simulate(two_stage_plan(), toy_layout(4), nodes,
                    SimConfig(streams=1, prompt_tokens=1, decode_tokens=40, speculative_tokens=3, acceptance=0.8))
    assert spec.stream_tokens_per_s > 1.8 * plain.stream_tokens_per_s


def test_same_seed_same_result_and_plans_from_make_plan_run():
    moe = MoESpec(n_experts=16, top_k=4, bytes_per_expert=GiB // 8, flops_per_expert_token=10**8)
    layout = toy_layout(3, moe=moe)
    nodes = [node(p, 3, rtt={q: 5.0 for q in "abc" if q != p}) for p in "abc"]
    plan = make_plan(layout, nodes, options=PLAIN)
    cfg = SimConfig(streams=3, prompt_tokens=8, decode_tokens=6, seed=3)
    first, second = simulate(plan, layout, nodes, cfg), simulate(plan, layout, nodes, cfg)
    assert first == second
    assert first.stream_tokens_per_s > 0 and first.first_token_ms > 0
