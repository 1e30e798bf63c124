"""A stage's expert calls that this daemon's own shard can answer whole are computed where the forward runs,
on the compute thread, with the same result as experts in the stage's own graph; the router counts them as
calls that hit one node and sent no message. A call that needs an expert the shard lacks goes to the router."""

from __future__ import annotations

import time

import numpy as np
import pytest

from models.expert_shard import ExpertShard
from models.moe import ExpertCall
from models.stage import StageInput, StageModel
from swarmd.inference.compute import use_a_kernel_cache_connection_per_thread
from swarmd.inference.moe.local import LocalExperts, holds_every_selected
from swarmd.inference.moe.router import MoERouter
from swarmd.inference.stage.batch import advance_here
from swarmd.observe.spans import SpanRecorder
from tests.models.tiny_gguf import TinyMoE, TinySpec, tiny_moe_weights, write_moe_gguf

# compiles and runs tinygrad kernels (seconds on a cold kernel cache)
pytestmark = pytest.mark.slow

SPEC = TinySpec(n_blocks=4)
MOE = TinyMoE(n_experts=6, top_k=2)
MOE_BLOCKS = (1, 2, 3)
PROMPT = np.array([5, 17, 42, 8, 91, 23, 60])


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    use_a_kernel_cache_connection_per_thread()
    return write_moe_gguf(tmp_path_factory.mktemp("moe") / "m.gguf", SPEC, MOE, tiny_moe_weights(SPEC, MOE, seed=6))


def run(stage: StageModel, items: list[StageInput], local: LocalExperts | None) -> tuple[bool, object, dict]:
    """One forward through `advance_here`: (done, the call left for the router, {"out": outputs} when done)."""
    got: dict = {}

    def steps():
        got["out"] = yield from stage.forward_steps(items)

    done, call = advance_here(steps(), None, None, local)
    return done, call, got


def test_a_call_is_answered_here_only_when_the_shard_holds_every_expert_it_selects():
    sel = np.array([[0, 3], [3, -1]], np.int32)
    assert holds_every_selected((0, 3, 5), sel)
    assert not holds_every_selected((0, 5), sel)
    assert not holds_every_selected((), np.array([[-1, -1]], np.int32))


def test_a_step_whose_experts_are_all_here_runs_through_and_equals_the_experts_in_the_stages_graph(gguf):
    whole = StageModel.from_gguf(gguf, max_context=32, max_requests=1, dtype="float32")
    stage = StageModel.from_gguf(gguf, max_context=32, max_requests=1, dtype="float32", local_experts=False)
    every = ExpertShard.from_gguf(gguf, {b: range(MOE.n_experts) for b in MOE_BLOCKS}, dtype="float32")
    router = MoERouter(None, lambda block: {})
    router.recorder = SpanRecorder()
    local = LocalExperts(lambda: every, router.record_local, clock=time.perf_counter)
    for model in (whole, stage):
        model.add_request("r")
    items = [StageInput("r", 0, PROMPT)]
    done, call, got = run(stage, items, local)
    assert done and call is None
    np.testing.assert_allclose(got["out"][0], whole.forward(items)[0], atol=1e-4, rtol=0)
    local.count({})  # on the event loop, once the step is off the compute thread
    router.recorder.trace("r")
    for step, pos in enumerate(range(len(PROMPT), len(PROMPT) + 3), start=1):  # past the jit's capture
        items = [StageInput("r", pos, np.array([pos % 50]))]
        done, _, got = run(stage, items, local)
        assert done
        np.testing.assert_allclose(got["out"][0], whole.forward(items)[0], atol=1e-4, rtol=0)
        local.count({"r": step})
    layers = router.status()["layers"]
    assert sorted(layers) == ["1", "2", "3"]
    for layer in layers.values():  # one prefill and three decode steps, each call one node and no message
        assert (layer["calls"], layer["local"], layer["messages"], layer["nodes_per_call"]) == (4, 4, 0, 1.0)
        assert sum(layer["tokens"].values()) == MOE.top_k * (len(PROMPT) + 3)
    fan_outs = [s for s in router.recorder.spans("r") if s[0] == "moe.fan_out"]
    assert [(s[4]["step"], s[4]["block"]) for s in fan_outs] == [(step, b) for step in (1, 2, 3) for b in MOE_BLOCKS]
    assert all(s[4]["messages"] == 0 and s[4]["nodes"] == 1 and s[4]["local"] for s in fan_outs)


def test_a_call_that_needs_an_expert_held_elsewhere_is_left_to_the_router(gguf):
    stage = StageModel.from_gguf(gguf, max_context=32, max_requests=1, dtype="float32", local_experts=False)
    some = ExpertShard.from_gguf(gguf, {b: [0, 3] for b in MOE_BLOCKS}, dtype="float32")
    counted: list = []
    for shard in (some, None):
        local = LocalExperts(lambda shard=shard: shard, lambda answer, traced: counted.append(answer),
                             clock=time.perf_counter)
        stage.add_request("r")
        done, call, _ = run(stage, [StageInput("r", 0, PROMPT)], local)
        assert not done and isinstance(call, ExpertCall) and call.layer == 1  # the prompt's rows pick others too
        local.count({})
        stage.free_request("r")
    assert counted == []
