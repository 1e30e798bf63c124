"""A token's steps on the hot lane, on whole daemons in one process (the in-memory twin, virtual time): a lone
request's decode steps run on the lane's readers, each after the first taken from its frame's bytes, and give the
tokens the event loop gives; steps the lane must not run (requests at once, which batch; a prefill) run on the
event loop as before."""

from __future__ import annotations

import pytest
import trio

from tests.swarm.tiny_model import write_tiny_llama
from tests.twin_swarm import stage_daemons, twin_swarm

pytestmark = pytest.mark.slow  # tinygrad runs the tiny model's steps

PROMPT = [40, 41, 42, 43, 44]
TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", n_blocks=6, vocab=300,
                            byte_tokenizer=True, scale=0.5)


def lane(d, key: str) -> int:
    return d.pipeline.status()["lane"]["stats"][key]


async def test_a_lone_requests_decode_steps_run_on_the_lane_and_give_the_event_loops_tokens(nursery, tmp_path, model,
                                                                                          autojump_clock):
    off, off_daemons = await twin_swarm(nursery, tmp_path / "off", model, 3, hot_lane=False)
    reference = await off.generate(off_daemons[0], PROMPT, max_tokens=TOKENS)
    assert all(d.pipeline.lane is None for d in off_daemons)
    twin, daemons = await twin_swarm(nursery, tmp_path / "on", model, 3)
    first = await twin.generate(daemons[0], PROMPT, max_tokens=TOKENS)  # measures each stage's decode step
    hot_before = {d.name: lane(d, "hot") for d in daemons}
    short_before = {d.name: lane(d, "shortcut") for d in daemons}
    ahead_before = {d.name: lane(d, "ahead") for d in daemons}
    again = await twin.generate(daemons[1], PROMPT, max_tokens=TOKENS)
    assert first == reference and again == reference
    for d in stage_daemons(twin, daemons):  # every decode step of the second request ran on a lane's reader
        assert lane(d, "hot") - hot_before[d.name] >= TOKENS - 2, d.pipeline.status()["lane"]
        # ... and each after its first there was taken from its frame's bytes (`swarmd.wire.follow`)
        assert lane(d, "shortcut") - short_before[d.name] >= TOKENS - 3, d.pipeline.status()["lane"]
        # ... its output down the chain written before its message was built, and the same message
        assert lane(d, "ahead") - ahead_before[d.name] >= TOKENS - 4, d.pipeline.status()["lane"]
        assert d.pipeline.stage.next_step.mismatched == 0
        steps = [(s["request_id"], s["step"]) for s in d.pipeline.status()["stage"]["recent_steps"]]
        assert len(steps) == len(set(steps))  # each step once


async def test_requests_at_once_take_the_event_loops_path_and_batch_there(nursery, tmp_path, model,
                                                                              autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, model, 3)
    alone = await twin.generate(daemons[0], PROMPT, max_tokens=TOKENS)
    declined = sum(lane(d, "declined") for d in daemons)
    results = {}

    async def one(i: int) -> None:
        results[i] = await twin.generate(daemons[i], PROMPT, max_tokens=TOKENS)

    async with trio.open_nursery() as at_once:
        for i in range(3):
            at_once.start_soon(one, i)
    assert all(r == alone for r in results.values())
    assert sum(lane(d, "declined") for d in daemons) > declined  # batched on the event loop
    assert max(d.pipeline.status()["stage"]["largest_batch"] for d in stage_daemons(twin, daemons)) >= 2
