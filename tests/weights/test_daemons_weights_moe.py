"""Acceptance: a MoE model (SmolLM2-MoE, 8 experts, top-2) on four daemons, only the founder holding its file.

The experts are spread over every daemon; each daemon fetches the attention and router tensors of its stage and
exactly the experts the plan gives it (its cache holds those bytes and the manifest, within 5 %), and the answer
equals the whole MoE model's in this process.
"""

from __future__ import annotations

import pytest

from models.gguf.header import read_header
from tests.swarm.daemons import wait_until
from tests.weights.cache_swarm import (
    CONTEXT,
    CacheSwarm,
    assignments,
    check_fetched_only_what_was_assigned,
    generate,
    greedy,
)

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]

MODEL = "smollm2-moe-8x2"


@pytest.fixture(scope="module")
def moe_file(smollm2_gguf):
    from models.catalog.names import resolve_model

    return resolve_model(MODEL).path  # derived from SmolLM2 into the test process's cache, once


def test_expert_holders_fetch_only_their_experts_and_the_answer_is_the_whole_models(
        tmp_path_factory, bench_file, moe_file):
    want = greedy(moe_file, numerics="float")  # what a MoE stage computes in (see swarmd.daemon.assignment)
    swarm = CacheSwarm(tmp_path_factory.mktemp("moe"), bench_file, MODEL,
                       extra=("--max-context", str(CONTEXT), "--expert-placement", "spread"))
    try:
        founder = swarm.daemon("a", holding=moe_file, in_cache=f"derived/{MODEL}.gguf").start().wait_ready(120)
        joiners = [swarm.daemon(n).start(bootstrap=(founder.addresses[0],)) for n in "bcd"]
        for d in joiners:
            d.wait_ready(120)
        plan = swarm.wait_ready_plan({d.peer_id for d in swarm.daemons.values()})
        header = read_header(moe_file)
        for name in "bcd":
            d = swarm.daemons[name]
            mine = {int(b): {int(e) for e, peers in by.items() if d.peer_id in peers}
                    for b, by in plan["experts"].items()}
            assert any(mine.values()), f"{name} holds no experts"
            _, experts = assignments(d.log_path.read_text())
            assert all(experts.get(b, set()) >= es for b, es in mine.items())
            check_fetched_only_what_was_assigned(swarm, name, header)
        assert not (swarm.models_dir("b") / "derived").exists()  # nothing was written locally
        # a member that turns ready may be given more work (a new plan): its experts count once they are loaded again
        wait_until(lambda: "experts 240/240 placed" in founder.status()["coverage"], 120, "every expert placed")
        assert generate(swarm.daemons["b"].api) == want
    finally:
        swarm.stop()
