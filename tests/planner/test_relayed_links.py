"""A hop through a relay is priced as two: the planner avoids it when it can, and predicts it slower."""

from __future__ import annotations

from dataclasses import replace

from planner import PlanOptions, make_plan
from planner.cost import relayed_pairs
from planner.node import NodeDescriptor
from tests.planner.planner_strategies import node, toy_layout

LAYOUT = toy_layout(4)  # 4 blocks of 1 GiB: two nodes of 2.5 GiB are needed
OPTS = PlanOptions(context_length=64, concurrency=1, runtime_overhead_bytes=0)


def fleet(*relayed: tuple[str, str], names: str = "AB") -> list[NodeDescriptor]:
    out = []
    for n in names:
        links = {b: "relayed" for a, b in relayed if a == n}
        out.append(replace(node(n, 2.5, uplink=10e6), links=links))
    return out


def test_either_side_reporting_a_relayed_link_marks_the_pair():
    m = relayed_pairs(fleet(("A", "B")))
    assert m[0, 1] and m[1, 0] and not m[0, 0]
    assert not relayed_pairs(fleet()).any()


def test_a_relayed_hop_is_predicted_slower_than_the_same_hop_direct():
    direct = make_plan(LAYOUT, fleet(), epoch=1, options=OPTS)
    relayed = make_plan(LAYOUT, fleet(("A", "B")), epoch=1, options=OPTS)
    assert [s.peer_id for s in direct.stages] == [s.peer_id for s in relayed.stages] == ["A", "B"]
    extra = relayed.predicted.token_latency_ms - direct.predicted.token_latency_ms

    def one_more(nbytes: int) -> float:  # a message's overhead and its transfer, once more
        return OPTS.hop_overhead_ms + nbytes * 8 / 10e6 * 1e3

    assert abs(extra - (one_more(1024) + one_more(8))) < 1e-6  # the hidden state there, the token back


def test_the_chain_goes_around_a_relayed_pair():
    """Four nodes that each hold one block; A and B reach each other only through a relay (and measure the
    detour's RTT): the chain's ring never puts them next to each other."""
    def ring(relayed: bool) -> list[str]:
        nodes = []
        for n in "ABCD":
            far = {"A": "B", "B": "A"}.get(n) if relayed else None
            nodes.append(replace(node(n, 1.5, uplink=10e6, rtt={m: 20.0 if m == far else 1.0 for m in "ABCD"
                                                                if m != n}),
                                 links={far: "relayed"} if far else {}))
        return [s.peer_id for s in make_plan(LAYOUT, nodes, epoch=1, options=OPTS).stages]

    assert ring(False) == ["A", "B", "C", "D"]
    chain = ring(True)
    neighbours = {frozenset((chain[i], chain[(i + 1) % len(chain)])) for i in range(len(chain))}
    assert len(chain) == 4 and frozenset("AB") not in neighbours


def test_descriptors_carry_their_links_through_json():
    n = replace(node("A", 1), links={"B": "relayed", "C": "data-plane"})
    assert NodeDescriptor.from_json(n.to_json()) == n
    assert "links" not in node("A", 1).to_json()
