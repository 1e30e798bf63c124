"""What nodes hold, as descriptors say it; what a plan must fetch; holders preferred only between equal plans."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner import NodeDescriptor, PlanSchemaError, make_plan
from planner.arch import BUILTIN_ARCHS, layout_from_arch
from planner.fetch import fetch_estimate
from planner.holdings import Holdings, format_holdings, parse_holdings
from planner.options import PlanOptions
from planner.plan import Plan

GiB = 1 << 30
LAYOUT = replace(layout_from_arch(BUILTIN_ARCHS["llama-3.2-1b"], "f16", name="llama"), stored_bytes=0)


def node(peer: str, holds: tuple[str, ...] = (), bandwidth: float = 100e9) -> NodeDescriptor:
    return NodeDescriptor(peer_id=peer, memory_total=8 * GiB, memory_free=8 * GiB, mem_bandwidth=bandwidth,
                          holds=holds)


def test_holdings_are_short_strings_that_read_back_as_written():
    items = format_holdings(embedding=True, blocks=[0, 1, 2, 5, 7, 8], experts={3: [0, 1, 2, 9], 4: []})
    assert items == ("e", "b0-2", "b5", "b7-8", "x3:0-2,9")
    h = parse_holdings(items)
    assert h == Holdings(embedding=True, blocks=frozenset({0, 1, 2, 5, 7, 8}), experts={3: frozenset({0, 1, 2, 9})})
    assert h.has_block(7) and not h.has_block(6) and h.has_expert(3, 9) and not h.has_expert(4, 0)
    assert parse_holdings(["*"]).has_expert(40, 300) and format_holdings(everything=True, blocks=[1]) == ("*",)
    assert not parse_holdings([]).anything


@pytest.mark.parametrize("bad", ["b", "b3-1", "bx", "x3", "x:1", "q", "b0-99999999999", "x3:1-a"])
def test_a_descriptor_with_holdings_in_another_syntax_is_refused(bad):
    with pytest.raises(PlanSchemaError):
        parse_holdings([bad])
    doc = node("A").to_json() | {"holds": [bad]}
    with pytest.raises(PlanSchemaError):
        NodeDescriptor.from_json(doc)
    assert NodeDescriptor.from_json(node("A", ("b0-3",)).to_json()).holds == ("b0-3",)


def test_a_plan_counts_what_its_nodes_must_fetch_and_when_it_will_be_ready():
    nodes = [node("A", ("*",)), node("B"), node("C", ("b8-15", "h"))]
    holdings = [parse_holdings(n.holds) for n in nodes]
    opts = PlanOptions(fetch_bytes_per_s=100e6, load_bytes_per_s=1e9)
    stages = [(0, 0, 8), (1, 8, 12), (2, 12, 16)]
    est = fetch_estimate(LAYOUT, nodes, holdings, stages, {}, opts)
    blocks = LAYOUT.blocks
    assert est.bytes_by_node == {1: sum(b.param_bytes for b in blocks[8:12])}  # C holds its blocks and the head
    assert est.fetch_s == pytest.approx(est.total_bytes / 100e6)
    assert est.ready_s > est.fetch_s  # then it loads
    stored = replace(LAYOUT, stored_bytes=LAYOUT.total_bytes // 4)  # a 4-bit file of a float16 layout
    assert fetch_estimate(stored, nodes, holdings, stages, {}, opts).total_bytes == pytest.approx(est.total_bytes / 4, 1)


def test_holders_keep_what_they_hold_when_the_plans_score_the_same():
    nodes = [node("A"), node("B"), node("C", ("*",)), node("D")]
    plan = make_plan(LAYOUT, nodes)
    first = plan.stages[0]
    assert first.peer_id == "C"  # the largest range (with the embedding) goes to the one that holds it
    assert plan.predicted.fetch_bytes > 0 and plan.predicted.ready_s > 0
    assert any("fetch" in r for r in plan.reasons)
    assert Plan.from_json(plan.to_json()) == plan
    nothing = make_plan(LAYOUT, [node(p) for p in "ABCD"])
    assert [s.layers for s in nothing.stages] == [s.layers for s in plan.stages]


def test_a_faster_node_gets_its_share_whatever_it_holds():
    nodes = [node("A", ("*",)), node("B", bandwidth=400e9)]
    plan = make_plan(LAYOUT, nodes)
    layers = {s.peer_id: s.layers[1] - s.layers[0] for s in plan.stages}
    assert layers["B"] > layers["A"]  # the better plan wins; holding decides only between equal ones
