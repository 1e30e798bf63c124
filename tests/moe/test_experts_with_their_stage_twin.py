"""A plan that keeps each MoE block's experts with its stage: for a DeepSeek-V3 / Kimi-K2 model each stage runs its
node's experts inside its graph, as `swarmd run` does (no graph cut, no expert call), and the tokens are those of
the model's graph cut after each router, as a swarm's are when its experts live elsewhere (whole daemons in one
process); a plan that takes an expert away cuts the stage's graph again, and one that gives it back joins it
(the node's assignment alone)."""

from __future__ import annotations

import pytest
import trio

from planner.plan import ModelRef, Plan, Stage
from swarmd.daemon.assignment import Assignment
from swarmd.daemon.served_model import served_model
from swarmd.inference.compute import ComputeThread
from swarmd.wire.gossip import PlanAnnouncement
from tests.models.tiny_deepseek2 import TinyDeepSeek2, tiny_deepseek2_weights, write_deepseek2_gguf
from tests.twin_swarm import stage_daemons, twin_swarm

pytestmark = pytest.mark.slow  # a few seconds: tinygrad runs the tiny model's steps

SPEC = TinyDeepSeek2()
PROMPT = [1, 5, 9, 33, 2, 70]


@pytest.fixture(scope="module")
def tiny_deepseek2(tmp_path_factory):
    w = tiny_deepseek2_weights(SPEC, seed=3)
    quant = {n: "Q4_0" for n, v in w.items() if v.ndim >= 2 and v.shape[-1] % 32 == 0 and "gate_inp" not in n}
    return write_deepseek2_gguf(tmp_path_factory.mktemp("deepseek2") / "tiny-deepseek2.gguf", SPEC, w, quant=quant)


def cut_graph_tokens(path, n: int) -> list[int]:
    """The greedy tokens of the whole model in this process, its graph cut after each router and its own shard
    answering each MoE block (the arithmetic of a swarm whose experts live elsewhere)."""
    from models.generate import generate
    from models.sampling import SamplingParams
    from models.stage import StageModel
    from models.text.tokenizer import Tokenizer

    model = StageModel.from_gguf(path, max_context=256, max_requests=1, dtype="quantized")
    assert len(model.segments) > 1
    gen = generate(model, Tokenizer.from_gguf(path), PROMPT, SamplingParams(max_tokens=n))
    for _ in gen:
        pass
    return gen.token_ids


async def test_stages_holding_their_experts_run_them_in_their_graphs_with_the_cut_graphs_tokens(
        nursery, tmp_path, tiny_deepseek2, autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, tiny_deepseek2, 2, expert_placement="local")
    stages = stage_daemons(twin, daemons)
    assert len(stages) == 2
    assert all(d.node.assignment.stage.experts_in_graph for d in stages)
    out = await twin.generate(daemons[1], PROMPT, max_tokens=8)
    assert not out.error and list(out.tokens) == cut_graph_tokens(tiny_deepseek2, 8)
    calls = sum(layer["calls"] for d in daemons for layer in d.pipeline.router.status()["layers"].values())
    assert calls == 0  # no step asked for experts


async def ready_at(a: Assignment, epoch: int) -> None:
    """Wait until the assignment has taken plan `epoch` and is ready."""
    while a.status().epoch != epoch or a.status().state != "ready":  # noqa: ASYNC110 - a status snapshot
        await trio.sleep(0.05)


@pytest.mark.usefixtures("tinygrad_in_process")
async def test_a_plan_that_takes_an_expert_away_cuts_the_stages_graph_and_one_that_gives_it_back_joins_it(tiny_deepseek2, monkeypatch):
    monkeypatch.setenv("SWARMD_GRAPH_CACHE", "off")
    me, other = "12D3KooWMe", "12D3KooWOther"
    every = {b: {e: (me,) for e in range(SPEC.n_experts)} for b in (1, 2)}
    one_away = {b: {e: (other if (b, e) == (2, 0) else me,) for e in range(SPEC.n_experts)} for b in (1, 2)}

    def announce(epoch: int, experts) -> PlanAnnouncement:
        plan = Plan(epoch=epoch, model=ModelRef("tiny"), stages=(Stage(me, (0, 3)),), experts=experts)
        return PlanAnnouncement(other, 1, plan)

    a = Assignment(me, served_model(str(tiny_deepseek2)), "CPU", ComputeThread(), max_context=64, max_requests=1)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            a.apply(announce(1, every))
            stage = await a.wait_ready()
            assert stage.experts_in_graph and stage.expert_shard is a.experts
            a.apply(announce(2, one_away))
            await ready_at(a, 2)
            assert not a.stage.experts_in_graph and len(a.stage.segments) > 1
            a.apply(announce(3, every))  # and given back: in the graph again
            await ready_at(a, 3)
            assert a.stage.experts_in_graph and a.stage.expert_shard is a.experts and len(a.stage.segments) == 1
            nursery.cancel_scope.cancel()
