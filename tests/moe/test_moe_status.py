"""What `swarmd status` says about a MoE plan: experts placed (held by a live member that loaded them)
and, per block, who holds which experts with the tokens routed to each."""

from __future__ import annotations

from rich.console import Console

from planner.layout import BlockLayout, ModelLayout, MoESpec
from swarmd.cli.status import experts_table
from swarmd.daemon.node import coverage

MOE = MoESpec(n_experts=3, top_k=2, bytes_per_expert=1, flops_per_expert_token=1)
LAYOUT = ModelLayout("m", "f16", (BlockLayout(1, 1, 1, 1), BlockLayout(1, 1, 1, 1, moe=MOE),
                                  BlockLayout(1, 1, 1, 1, moe=MOE)), 1, 1, 1, 8, 16)
PLAN = {"epoch": 3, "stages": [{"peer_id": "A", "layers": [0, 3], "actors": ["stage-0"]}],
        "experts": {"1": {"0": ["A"], "1": ["B"], "2": ["C", "B"]}, "2": {"0": ["B"], "1": ["C"], "2": ["C"]}}}


def member(peer: str, experts: dict, state: str = "ready", alive: str = "alive") -> dict:
    return {"peer_id": peer, "state": alive,
            "assignment": {"layers": [0, 3] if peer == "A" else None, "state": state, "experts": experts}}


def test_coverage_counts_experts_held_by_live_members_that_loaded_them():
    members = [member("A", {"1": [0]}), member("B", {"1": [1, 2], "2": [0]}), member("C", {"1": [2], "2": [1, 2]})]
    assert coverage(PLAN, members, LAYOUT) == "layers 0-2 covered; experts 6/6 placed"
    members[2]["state"] = "dead"  # expert 1.2 still has B; 2.1 and 2.2 had only C
    assert coverage(PLAN, members, LAYOUT).endswith("experts 4/6 placed")
    members[1]["assignment"]["state"] = "loading"
    assert coverage(PLAN, members, LAYOUT).endswith("experts 1/6 placed")


def test_the_experts_table_shows_holders_and_tokens_routed():
    moe = {"placement": PLAN["experts"], "routed": {"1": {"tokens": {"0": 7, "2": 3}}},
           "computed_here": {"tokens": {"2": {"1": 4}}}}
    console = Console(width=120, record=True)
    console.print(experts_table(moe))
    text = console.export_text()
    assert "A: 0" in text and "B: 1,2" in text and "C: 2" in text
    assert "0:7 2:3" in text and "1:4" in text
