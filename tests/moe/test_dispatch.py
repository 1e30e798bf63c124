"""Spreading a MoE layer's step over expert holders: one batched part per node, combined back exactly."""

from __future__ import annotations

import numpy as np

from models.moe import ExpertCall
from swarmd.inference.moe.dispatch import (
    ReplicaChooser,
    combine,
    give_up_reason,
    split_by_node,
    tokens_per_expert,
    unserved,
)


def call(sel: list[list[int]], dim: int = 4) -> ExpertCall:
    sel_a = np.array(sel, np.int32)
    rows = np.arange(sel_a.shape[0] * dim, dtype=np.float32).reshape(-1, dim)
    gates = np.full(sel_a.shape, 0.5, np.float32)
    return ExpertCall(3, rows, sel_a, gates)


HOLDERS = {0: ("a",), 1: ("b",), 2: ("a",), 3: ("c", "b")}


def test_each_node_gets_one_part_with_only_the_rows_that_select_its_experts():
    c = call([[0, 1], [2, 0], [3, 2]])
    parts = split_by_node(c, HOLDERS, ReplicaChooser(lambda: 0.0).choose)
    assert [(p.peer, p.experts, p.rows.tolist()) for p in parts] == [
        ("a", (0, 2), [0, 1, 2]), ("b", (1,), [0]), ("c", (3,), [2])]
    a = parts[0].call
    assert a.sel.tolist() == [[0, -1], [2, 0], [-1, 2]] and a.gates.tolist() == [[0.5, 0], [0.5, 0.5], [0, 0.5]]
    assert len(parts) == 3  # messages for this layer and step: distinct nodes hit, not rows x k


def test_combine_makes_each_rows_gated_sum_of_the_nodes_expert_outputs():
    c = call([[0, 1], [2, 0], [3, 2]])
    parts = split_by_node(c, HOLDERS, ReplicaChooser(lambda: 0.0).choose)
    # node i answers 10 * (i + 1) + the expert's index for each selection it holds
    answers = [(p, np.repeat((10 * (i + 1) + p.call.sel[p.call.sel >= 0])[:, None], 4, axis=1).astype(np.float32))
               for i, p in enumerate(parts)]
    assert combine(c, answers)[:, 0].tolist() == [0.5 * 10 + 0.5 * 21, 0.5 * 12 + 0.5 * 10, 0.5 * 33 + 0.5 * 12]


def test_a_rows_sum_is_the_same_bits_however_its_experts_are_spread():
    rng = np.random.default_rng(0)
    sel = np.array([[3, 0, 2, 1], [1, 2, 0, 3]], np.int32)
    c = ExpertCall(5, rng.standard_normal((2, 8)).astype(np.float32), sel,
                   rng.uniform(0, 3, sel.shape).astype(np.float32))
    outputs = {e: rng.standard_normal((2, 8)).astype(np.float32) * 10 ** e for e in range(4)}  # per expert, per row

    def answer(p):
        rows, k = np.nonzero(p.call.sel >= 0)
        return np.stack([outputs[int(p.call.sel[r, j])][p.rows[r]] for r, j in zip(rows, k, strict=True)])

    sums = []
    for holders in ({e: ("a",) for e in range(4)}, {0: ("a",), 1: ("b",), 2: ("c",), 3: ("b",)},
                    {0: ("c",), 1: ("a",), 2: ("a",), 3: ("b",)}):
        parts = split_by_node(c, holders, ReplicaChooser(lambda: 0.0).choose)
        sums.append(combine(c, [(p, answer(p)) for p in parts]))
    assert all(np.array_equal(s, sums[0]) for s in sums[1:])


def test_a_replica_is_chosen_by_latency_times_load_and_ties_follow_the_plan_order():
    chooser = ReplicaChooser(lambda: 0.0)
    assert chooser.choose(("c", "b")) == "c"  # nothing measured: the Plan's nearest first
    chooser.finished("c", 0.050)
    chooser.finished("b", 0.002)
    assert chooser.choose(("c", "b")) == "b"
    for _ in range(30):
        chooser.started("b")  # b is busy: its queue makes it slower than c now
    assert chooser.choose(("c", "b")) == "c"
    assert chooser.choose(("c", "b"), avoid={"c"}) == "b"
    assert chooser.choose(("c",), avoid={"c"}) is None


def test_a_failed_replica_is_avoided_until_it_answers_fast_again():
    chooser = ReplicaChooser(lambda: 0.0)
    chooser.finished("b", 0.200)  # slow, but it answers
    chooser.finished("c", None)
    assert chooser.choose(("c", "b")) == "b"
    for _ in range(20):
        chooser.finished("c", 0.001)
    assert chooser.choose(("c", "b")) == "c"


def test_a_failed_replica_stays_behind_a_holder_first_measured_slow_after_it_failed():
    chooser = ReplicaChooser(lambda: 0.0)
    chooser.finished("c", None)  # failed while nothing was measured yet
    chooser.finished("b", 3.0)  # then b answered, slowly (its first batch compiled kernels)
    assert chooser.choose(("c", "b")) == "b"
    for _ in range(10):  # c answers fast again
        chooser.finished("c", 0.001)
    assert chooser.choose(("c", "b")) == "c"


def test_an_estimate_no_call_refreshes_relaxes_so_a_holder_shunned_once_is_tried_again():
    now = [0.0]
    chooser = ReplicaChooser(lambda: now[0])
    chooser.finished("c", 0.400)  # its first batch compiled kernels
    chooser.finished("b", 0.010)
    assert chooser.choose(("c", "b")) == "b"
    for t in range(1, 11):  # b answers in 10 ms all along
        now[0] = t * chooser.half_life_s
        chooser.finished("b", 0.010)
        if t == 3:  # c's estimate is 1/8 of its excess over the prior: still slower than b
            assert chooser.choose(("c", "b")) == "b"
    assert chooser.choose(("c", "b")) == "c"  # an unrefreshed estimate drifts back to the prior: c is asked again
    chooser.finished("c", None)  # and if it fails it is shunned again, for a while
    assert chooser.choose(("c", "b")) == "b"


def test_load_counts_tokens_per_expert():
    assert tokens_per_expert(call([[0, 1], [2, 0], [3, -1]])) == {0: 2, 1: 1, 2: 1, 3: 1}


def test_an_expert_is_unserved_only_when_every_holder_is_unusable():
    c = call([[0, 3], [1, 3]])
    assert unserved(c, HOLDERS, {"c"}) == []  # expert 3 still has b
    assert unserved(c, HOLDERS, {"c", "b"}) == [1, 3]
    assert unserved(c, HOLDERS, {"a"}) == [0]
    assert unserved(c, {**HOLDERS, 1: ()}, set()) == [1]  # a plan that places it nowhere


def test_a_step_waits_for_a_new_plan_until_its_limit_or_until_the_swarm_is_known_unable_to_hold_the_experts():
    assert give_up_reason([3], 2, waited=5.0, limit=60.0) is None
    late = give_up_reason([3, 5], 2, waited=60.0, limit=60.0)
    assert late == "experts 3, 5 of block 2 have no reachable holder and no new plan placed them on a live node within 60 s"
    full = give_up_reason([3], 2, waited=0.0, limit=60.0, cannot_hold="needs 1.0 GiB more memory for the experts")
    assert full == ("expert 3 of block 2 has no live holder and the swarm cannot hold it: needs 1.0 GiB more "
                    "memory for the experts")
