"""Acceptance: `kill -9` of a peer serving weights mid-fetch; the fetch resumes from another holder.

Two daemons hold SmolLM2 (each its own copy) and serve it slowly (24 Mbit/s each), so that a third, joining with
an empty cache, is still fetching its stage when one holder is killed. The joiner keeps what it has, fetches the
rest from the survivor, including the blocks its grown range (the re-plan over two daemons) adds, and the
answer equals the whole model's.
"""

from __future__ import annotations

import pytest

from models.gguf.header import read_header
from swarmd.net.identity import short_id
from tests.swarm.daemons import wait_until
from tests.weights.cache_swarm import CONTEXT, CacheSwarm, check_fetched_only_what_was_assigned, generate

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]

SMOLLM2_IN_CACHE = "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_kill_9_of_the_serving_peer_mid_fetch_the_fetch_resumes_from_another_holder(
        tmp_path_factory, bench_file, smollm2_gguf, want):
    swarm = CacheSwarm(tmp_path_factory.mktemp("failover"), bench_file, "smollm2-135m",
                       extra=("--max-context", str(CONTEXT), "--weights-serve-mbps", "24", "--weights-busy-mbps", "24"))
    try:
        a = swarm.daemon("a", holding=smollm2_gguf, in_cache=SMOLLM2_IN_CACHE).start().wait_ready(120)
        h = swarm.daemon("h", holding=smollm2_gguf, in_cache=SMOLLM2_IN_CACHE)
        h.start(bootstrap=(a.addresses[0],)).wait_ready(120)
        swarm.wait_ready_plan({a.peer_id, h.peer_id})
        g = swarm.daemon("g").start(bootstrap=(a.addresses[0],)).wait_ready(120)

        def fetching_from_both() -> bool:
            w = g.status()["weights"]
            return w["fetch"]["active"] and w.get("fetched_from", {}).get(h.peer_id, 0) >= 1 << 20 \
                and w["fetch"]["bytes"] < w["fetch"]["total"] // 2

        wait_until(fetching_from_both, 120, "the joiner fetching from both holders")
        h.kill9()
        swarm.wait_ready_plan({a.peer_id, g.peer_id})
        log = g.log_path.read_text()
        assert f"lost weights source {short_id(h.peer_id)}" in log, g.log()
        fetched = g.status()["weights"]["fetched_from"]
        assert fetched[a.peer_id] > 0 and fetched[h.peer_id] >= 1 << 20
        check_fetched_only_what_was_assigned(swarm, "g", read_header(smollm2_gguf))
        assert generate(g.api) == want
    finally:
        swarm.stop()
