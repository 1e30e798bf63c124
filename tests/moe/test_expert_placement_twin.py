"""Where a swarm's experts go when daemons join one by one (`--expert-placement spread`, the balanced policy),
on whole daemons in one process: every member works and the experts leave the founder, even when the members
that join are slower than it (on a loaded machine, daemons started together each measure a fraction of the
CPU), and the tokens are those of one daemon holding everything."""

from __future__ import annotations

import pytest
import trio

from swarmd.testing.twin import BENCH
from tests.moe.moe_swarm import write_tiny_moe
from tests.twin_swarm import twin_swarm

pytestmark = pytest.mark.slow  # a few seconds: tinygrad runs the tiny model's steps

PROMPT = [40, 41, 42, 43, 44]
SLOWER = {"flops": BENCH["flops"] / 8, "mem_bandwidth": BENCH["mem_bandwidth"] / 8}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf")


def holders(plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for by_expert in plan.experts.values():
        for peers in by_expert.values():
            for p in peers:
                out[p] = out.get(p, 0) + 1
    return out


async def test_spread_experts_reach_every_member_when_slower_members_join_one_by_one(nursery, tmp_path, tiny_moe,
                                                                                      autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, tiny_moe, 4, memory_limit=2 << 30,
                                     expert_placement="spread", per_daemon={i: {"bench": SLOWER} for i in (1, 2, 3)})
    with trio.move_on_after(30):  # the members join one by one: the leader re-plans once they are all in
        while len(daemons[0].node.plan.peers()) < 4 or not daemons[0].pipeline.chain().ready:  # noqa: ASYNC110
            await trio.sleep(0.5)
    plan = daemons[0].node.plan
    held = holders(plan)
    working = {s.peer_id for s in plan.stages} | set(held)
    assert working == {d.peer_id for d in daemons}, plan.reasons  # every member has work
    assert len(held) >= 3, held  # and the experts really are spread
    assert any(s.peer_id != daemons[0].peer_id for s in plan.stages) or len(held) == 4

    alone, _ = await twin_swarm(nursery, tmp_path / "alone", tiny_moe, 1, memory_limit=2 << 30,
                                expert_placement="spread")
    spread = await twin.generate(daemons[1], PROMPT, max_tokens=12)
    reference = await alone.generate(alone.daemons[0], PROMPT, max_tokens=12)
    assert not spread.error and spread.tokens == reference.tokens
    routed = sum(layer["messages"] for d in daemons
                 for layer in d.pipeline.router.status()["layers"].values())
    assert routed > 0  # expert batches went to other daemons
