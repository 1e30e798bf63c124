"""No hangs: when the daemons left cannot hold the model, a request in flight ends with a clear error within
seconds, and `swarmd status` says why. Two real daemons, each allowed too little memory for the whole model."""

from __future__ import annotations

import json
import time

import pytest

from tests.faults.fault_swarm import FaultSwarm

pytestmark = pytest.mark.slow

PROMPT = "The history of the printing press begins in"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, bench_file):
    # SmolLM2 with 256 MiB of runtime overhead per daemon: half of it fits in 560 MB, the whole does not
    swarm = FaultSwarm(tmp_path_factory.mktemp("small"), bench_file, 2,
                       extra=("--max-context", "256", "--memory-limit", "560MB"))
    try:
        yield swarm.start()
    finally:
        swarm.stop()


def test_a_request_ends_with_a_clear_error_when_the_rest_of_the_swarm_cannot_hold_the_model(swarm):
    leader = swarm.running[0].status()["leader"]
    head = swarm.index_of(leader)
    other = 1 - head
    killed: list[float] = []

    def kill(n: int) -> None:
        if n == 4:
            killed.append(time.monotonic())
            swarm.daemons[other].kill9()

    pairs, end = swarm.stream(head, prompt=PROMPT, max_tokens=200, on_token=kill)
    assert end["event"] == "error", end
    assert end["code"] == "swarm_too_small" and "cannot hold the model" in end["message"], end
    assert time.monotonic() - killed[0] < 60  # a deadline of seconds, not the two-minute wait for a chain
    assert [s for s, _ in pairs] == list(range(len(pairs)))  # what was streamed was streamed once, in order

    text = swarm.daemons[head].status_cli()
    assert text.returncode == 0 and "not covered" in text.stdout, text.stdout
    doc = json.loads(swarm.daemons[head].status_cli("--json").stdout)
    assert "not covered" in doc["coverage"] and "more memory" in doc["plan_error"], doc["plan_error"]
