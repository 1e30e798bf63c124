"""Faults done to whole daemons in one process (`swarmd.testing.twin`: the daemons' own code on the in-memory
network, in virtual time): dropped links (frames sent again, each step run once), a stage leaving, the leader
dying with a request of its own, and a swarm left too small. Each request gives the undisturbed run's tokens or ends with a clear
error. `tests/simulation` draws such faults at random by the hundred; these are the named cases."""

from __future__ import annotations

import pytest
import trio

from tests.swarm.tiny_model import write_tiny_llama
from tests.twin_swarm import stage_daemons, twin_swarm

pytestmark = pytest.mark.slow  # a few seconds each: tinygrad runs the tiny model's steps

PROMPT = [40, 41, 42, 43, 44]
OTHER = [7, 100, 7, 100, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", n_blocks=6, vocab=300,
                            byte_tokenizer=True, scale=0.5)


def resent(d) -> int:
    """Frames a daemon sent again: by the transport on a new stream, or that its hot lane handed to the
    transport when the lane broke."""
    lane = d.pipeline.lane
    return d.pipeline.transport.stats.resent + (lane.stats.fell_back if lane is not None else 0)


async def test_resets_on_every_link_during_prefill_and_decode_change_no_token(nursery, tmp_path, model,
                                                                              autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, model, 3)
    undisturbed = await twin.generate(daemons[0], PROMPT, max_tokens=16)
    assert not undisturbed.error and len(undisturbed.tokens) == 16
    resent_before = sum(resent(d) for d in daemons)
    for a in daemons:  # a delay keeps frames on the wire long enough for a reset to catch them
        for b in daemons:
            if a is not b:
                twin.hub.set_delay(a.peer_id, b.peer_id, 0.04)

    async def reset_during_prefill() -> None:
        await trio.sleep(0.05)
        twin.hub.reset()

    nursery.start_soon(reset_during_prefill)
    again = await twin.generate(daemons[0], PROMPT, max_tokens=16,
                                on_token=lambda n: twin.hub.reset() if n in (2, 6, 12) else None)
    assert again == undisturbed  # the same tokens, in order
    assert sum(resent(d) for d in daemons) > resent_before  # frames were sent again,
    for d in stage_daemons(twin, daemons):  # and yet each step ran once: no KV cache row appended twice
        steps = [(s["request_id"], s["step"]) for s in d.pipeline.status()["stage"]["recent_steps"]]
        assert len(steps) == len(set(steps))
    assert all(d.alive for d in daemons)


async def test_a_stage_that_leaves_on_purpose_drains_and_no_request_sees_an_error(nursery, tmp_path, model,
                                                                                autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, model, 3, stages=2)  # two can hold it
    undisturbed = await twin.generate(daemons[0], PROMPT, max_tokens=16)
    goes = stage_daemons(twin, daemons)[-1]
    head = next(d for d in daemons if d is not goes)

    def leave(n: int) -> None:
        if n == 6:
            nursery.start_soon(twin.leave, goes)

    again = await twin.generate(head, PROMPT, max_tokens=16, on_token=leave)
    assert again == undisturbed
    await goes.stopped.wait()
    assert not goes.errors
    await twin.wait_ready(head)
    assert goes.peer_id not in {s.peer_id for s in head.node.plan.stages}


async def test_a_dead_leader_and_head_ends_its_request_only_and_a_new_leader_takes_over(nursery, tmp_path, model,
                                                                                      autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, model, 4, stages=3)  # three can hold it
    undisturbed = await twin.generate(daemons[1], PROMPT, max_tokens=16)
    leader = next(d for d in daemons if d.peer_id == daemons[0].node.swarm.leader)
    survivor = next(d for d in daemons if d is not leader)
    term = survivor.node.swarm.term
    outcomes = {}

    async def doomed() -> None:
        outcomes["doomed"] = await twin.generate(leader, OTHER, max_tokens=60,
                                                 on_token=lambda n: twin.crash(leader) if n == 4 else None)

    async with trio.open_nursery() as requests:
        requests.start_soon(doomed)
        await trio.sleep(0.5)
        outcomes["lives"] = await twin.generate(survivor, PROMPT, max_tokens=16)
    assert outcomes["doomed"].error  # the killed head's request ended for its client
    assert outcomes["lives"] == undisturbed, outcomes["lives"].error  # it went on, moved if it passed the dead
    with trio.fail_after(30):
        while survivor.node.swarm.leader in (leader.peer_id, None):  # noqa: ASYNC110 - a status snapshot
            await trio.sleep(0.25)
    assert survivor.node.swarm.term > term
    with trio.fail_after(30):  # the dead head's request no longer holds a KV cache anywhere
        while any(d.pipeline.stage.book and d.pipeline.stage.book.requests for d in twin.alive()):  # noqa: ASYNC110
            await trio.sleep(0.25)


async def test_a_request_ends_with_a_clear_error_when_the_rest_of_the_swarm_cannot_hold_the_model(
        nursery, tmp_path, model, autojump_clock):
    from planner import PlanOptions
    from planner.memory import stage_bytes
    from swarmd.daemon.served_model import served_model

    layout = served_model(str(model)).layout
    opts = PlanOptions(context_length=128, concurrency=4)
    n = layout.n_blocks
    halves = max(stage_bytes(layout, 0, n // 2 + 1, opts), stage_bytes(layout, n // 2, n, opts))
    assert halves < stage_bytes(layout, 0, n, opts)
    limit = opts.runtime_overhead_bytes + halves  # one daemon holds half the model and a block, not all of it
    twin, daemons = await twin_swarm(nursery, tmp_path, model, 2, memory_limit=limit)
    leader = next(d for d in daemons if d.peer_id == daemons[0].node.swarm.leader)
    other = next(d for d in daemons if d is not leader)
    killed: list[float] = []

    def kill(n: int) -> None:
        if n == 4:
            killed.append(trio.current_time())
            twin.crash(other)

    out = await twin.generate(leader, PROMPT, max_tokens=60, on_token=kill)
    assert out.error.startswith("swarm_too_small") and "cannot hold the model" in out.error, out.error
    assert trio.current_time() - killed[0] < 30  # a deadline of seconds, not the wait for a chain
    status = leader.node.status()
    assert "not covered" in status["coverage"] and "more memory" in status["plan_error"], status["plan_error"]
