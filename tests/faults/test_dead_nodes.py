"""kill -9 of a stage mid-stream, as a user would do it: the swarm heals and the request gives the undisturbed
run's tokens. Four real daemons on loopback: three serve SmolLM2 split in three, the fourth is a spare
(`--standby`) holding a warm copy of one stage, which takes the killed stage's place with nothing to load.
Other faults (a stage leaving, the leader dying, resets, a swarm left too small) are in `test_faults.py` and
`tests/simulation`, on whole daemons in one process.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.faults.fault_swarm import FaultSwarm
from tests.swarm.daemons import http

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]  # the module fixture starts 4 daemons and warms a spare

CONTEXT = 256
PROMPT = "The history of the printing press begins in"
OTHER = "def fibonacci(n):"
N_TOKENS = 24


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, bench_file):
    swarm = FaultSwarm(tmp_path_factory.mktemp("dead"), bench_file, 4, extra=("--max-context", str(CONTEXT)),
                       standby=1)
    try:
        yield swarm.start()
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def undisturbed(swarm) -> dict[str, list[tuple[int, int]]]:
    out = {}
    for prompt in (PROMPT, OTHER):
        pairs, end = swarm.stream(swarm.index_of(stage_peers(swarm)[0]), prompt=prompt, max_tokens=N_TOKENS)
        assert end["event"] == "done" and [s for s, _ in pairs] == list(range(N_TOKENS)), end
        out[prompt] = pairs
    return out


def stage_peers(swarm: FaultSwarm) -> list[str]:
    plan = swarm.running[0].status()["plan"]
    return [s["peer_id"] for s in plan["stages"]]


def stage_status(swarm: FaultSwarm, peer: str) -> dict | None:
    return http.get(f"{swarm.daemons[swarm.index_of(peer)].api}/api/v0/pipeline", timeout=10).json()["stage"]


def kv_counts(swarm: FaultSwarm, peer: str) -> tuple[int, int]:
    """How many moved requests a stage daemon continued keeping their KV cache, and rebuilding it."""
    stage = stage_status(swarm, peer) or {}
    return stage.get("kv_adopted", 0), stage.get("kv_rebuilt", 0)


def leader(swarm: FaultSwarm) -> str:
    return swarm.running[0].status()["leader"]


def test_a_killed_stage_is_taken_over_by_the_spare_holding_its_copy_and_the_text_is_the_undisturbed_runs(
        swarm, undisturbed):
    plan = swarm.running[0].status()["plan"]
    [(spare, copy)] = swarm.standby_of(plan).items()
    stages = stage_peers(swarm)
    victim = next(swarm.index_of(s["peer_id"]) for s in plan["stages"] if tuple(s["layers"]) == copy)
    assert swarm.peers[victim] != leader(swarm)
    head = swarm.index_of(stages[0])
    before_counts = {p: kv_counts(swarm, p) for p in stages}
    killed: list[float] = []

    def kill(n: int) -> None:
        if n == 6:
            killed.append(time.time())
            swarm.daemons[victim].kill9()

    pairs, end = swarm.stream(head, prompt=PROMPT, max_tokens=N_TOKENS, on_token=kill)
    assert end["event"] == "done", f"{end}\n{swarm.logs()}"
    assert pairs == undisturbed[PROMPT]  # no token repeated, none skipped, the same text
    assert end["recoveries"], end
    print("recovery:", json.dumps(end["recoveries"]))
    after = swarm.running[0].status()["plan"]
    before = {s["peer_id"]: s["layers"] for s in plan["stages"]}
    # the spare runs exactly the lost blocks, the survivors keep theirs, and the spare loaded nothing
    assert {s["peer_id"]: s["layers"] for s in after["stages"]} == {
        **{p: layers for p, layers in before.items() if p != swarm.peers[victim]}, spare: list(copy)}
    # only the spare rebuilt the request's KV cache (from the rows the stage before it kept): the survivors
    # kept theirs and computed the last position again, not the history
    move = end["recoveries"][-1]
    assert move["rebuild"] == "hop_local", move
    for peer in after["stages"]:
        stage = stage_status(swarm, peer["peer_id"])
        resumed = [s for s in stage["recent_steps"] if ".r" in s["request_id"]]
        first = next(s for s in resumed if s["request_id"] == resumed[-1]["request_id"])
        adopted, rebuilt = (a - b for a, b in zip(kv_counts(swarm, peer["peer_id"]),
                                                  before_counts.get(peer["peer_id"], (0, 0)), strict=True))
        if peer["peer_id"] == spare:
            assert (first["rows"], adopted, rebuilt) == (move["replayed_tokens"], 0, 1), stage
        else:
            assert (first["rows"], adopted, rebuilt) == (1, 1, 0), stage
    spare_log = swarm.daemons[swarm.index_of(spare)].log_path.read_text()
    assert "ready: blocks" not in spare_log and "loading blocks" not in spare_log
    # dead because its port refused the redials, not after a whole suspicion timeout
    detected = swarm.daemons[swarm.index_of(leader(swarm))].log_path.read_text()
    assert f"member {swarm.peers[victim][-6:]}: suspect -> dead (connection lost and" in detected
