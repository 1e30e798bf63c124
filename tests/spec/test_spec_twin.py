"""Speculative decoding through whole daemons in one process (the in-memory twin, virtual time): heads that draft
with prompt lookup or with a draft model give, token for token, what the model run whole gives (`models.generate`,
the loop behind `swarmd run`), alone, several at once, on a MoE model with its experts spread, and across a dead
stage; sampled requests replay from their seed; a draft model of another vocabulary is refused."""

from __future__ import annotations

import pytest
import trio

from swarmd.inference.head.service import HeadError, HeadRequest
from swarmd.inference.head.session import TokenOut
from swarmd.spec_settings import SpecRequest
from tests.swarm.tiny_model import write_tiny_llama
from tests.twin_swarm import stage_daemons, twin_swarm

pytestmark = pytest.mark.slow  # tinygrad compiles the tiny models' kernels

CONTEXT = 128
N_TOKENS = 24
# byte prompts that repeat themselves and one that does not. The random model's continuations repeat no pair of
# tokens, so prompt lookup finds nothing to draft here: the draft models' heads are the ones that verify drafts
# (tests/spec/test_daemons_spec.py has prompt lookup's drafts accepted on a real model)
PROMPTS = ([40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [7, 100, 7, 100, 9, 7, 100], [250, 3, 17])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = write_tiny_llama(root / "tiny.gguf", n_blocks=6, vocab=300, byte_tokenizer=True, scale=0.5)
    other = write_tiny_llama(root / "draft.gguf", n_blocks=2, vocab=300, byte_tokenizer=True, scale=0.5, seed=3)
    alien = write_tiny_llama(root / "alien.gguf", n_blocks=2, vocab=320, byte_tokenizer=True, scale=0.5, seed=4)
    return {"target": target, "other": other, "alien": alien}


def whole_model_tokens(path, prompts, n_tokens: int = N_TOKENS) -> list[list[int]]:
    from models.config import config_from_header
    from models.generate import generate
    from models.gguf.header import read_header
    from models.sampling import SamplingParams
    from models.stage import StageModel, serving_numerics
    from models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    whole = StageModel.from_gguf(path, max_context=CONTEXT, max_requests=1,
                                 numerics=serving_numerics(config_from_header(read_header(path))))
    out = []
    for ids in prompts:
        gen = generate(whole, tok, ids, SamplingParams(max_tokens=n_tokens))
        for _ in gen:
            pass
        out.append(gen.token_ids)
    return out


@pytest.fixture(scope="module")
def reference(models) -> list[list[int]]:
    return whole_model_tokens(models["target"], PROMPTS)


async def test_drafting_heads_generate_token_for_token_what_swarmd_run_generates(nursery, tmp_path, models,
                                                                                reference, autojump_clock):
    heads = {0: {"speculate": "ngram"}, 1: {"speculate": f"model:{models['target']}"},  # a drafter that is right
             2: {"speculate": f"model:{models['other']}", "draft_tokens": 3}}  # one that is mostly wrong
    twin, daemons = await twin_swarm(nursery, tmp_path, models["target"], 3, max_context=CONTEXT, per_daemon=heads)
    for head in daemons:
        for ids, want in zip(PROMPTS, reference, strict=True):
            got = await twin.generate(head, ids, max_tokens=N_TOKENS)
            assert not got.error and list(got.tokens) == want, (head.name, ids, got)
    stats = [d.pipeline.head.speculation.stats for d in daemons]
    assert stats[1].drafted > 0 and stats[1].accepted == stats[1].drafted  # the target drafting for itself
    assert stats[1].passes < 3 * N_TOKENS / 2  # several tokens a pass
    assert stats[2].drafted > 0 and all(s.passes for s in stats)
    steps = [s for d in stage_daemons(twin, daemons) for s in d.pipeline.status()["stage"]["recent_steps"]]
    assert max(s["rows"] for s in steps if s["step"] > 0) > 1  # verify steps of several rows went down the chain

    results = {}

    async def one(i: int) -> None:
        results[i] = await twin.generate(daemons[i % 2], PROMPTS[i], max_tokens=N_TOKENS)

    async with trio.open_nursery() as at_once:
        for i in range(len(PROMPTS)):
            at_once.start_soon(one, i)
    assert [list(results[i].tokens) for i in range(len(PROMPTS))] == reference
    assert max(d.pipeline.status()["stage"]["largest_batch"] for d in stage_daemons(twin, daemons)) >= 2


async def test_a_request_chooses_its_own_speculation_and_a_bad_choice_is_refused(nursery, tmp_path, models,
                                                                                 reference, autojump_clock):
    _twin, daemons = await twin_swarm(nursery, tmp_path, models["target"], 2, max_context=CONTEXT,
                                     per_daemon={0: {"speculate": "ngram"}})
    head = daemons[0].pipeline.head
    async with head.open(HeadRequest(tuple(PROMPTS[0]), 4, speculate=SpecRequest("off"))) as handle:
        assert handle.spec is None
        async for _ in handle:
            pass
    assert head.speculation.stats.passes == 0
    # a draft model the daemon was not started with, loaded for the request that names it
    drafter = SpecRequest(f"model:{models['target']}", draft_tokens=3)
    async with head.open(HeadRequest(tuple(PROMPTS[0]), N_TOKENS, speculate=drafter)) as handle:
        assert handle.spec is not None and handle.spec.settings.mode == f"model:{models['target']}"
        tokens = [e.token_id async for e in handle if isinstance(e, TokenOut)]
    assert tokens == reference[0] and head.speculation.stats.accepted > 0
    for asked, words in ((SpecRequest(draft_tokens=9), "1 to 4"),
                         (SpecRequest(f"model:{models['alien']}"), "another vocabulary"),
                         (SpecRequest("model:/nowhere/missing.gguf"), "missing.gguf")):
        with pytest.raises(HeadError) as e:
            async with head.open(HeadRequest(tuple(PROMPTS[0]), 4, speculate=asked)):
                pass
        assert e.value.code == "bad_speculate" and e.value.status == 400 and words in e.value.message


async def test_sampled_speculative_requests_replay_from_their_seed(nursery, tmp_path, models, autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, models["target"], 2, max_context=CONTEXT,
                                     per_daemon={0: {"speculate": f"model:{models['other']}"},
                                                 1: {"speculate": "ngram"}})
    for head in daemons:
        runs = [await twin.generate(head, PROMPTS[0], max_tokens=N_TOKENS, seed=11, temperature=0.8)
                for _ in range(2)]
        assert not runs[0].error and runs[0] == runs[1] and len(runs[0].tokens) == N_TOKENS
        other = await twin.generate(head, PROMPTS[0], max_tokens=N_TOKENS, seed=12, temperature=0.8)
        assert other.tokens != runs[0].tokens
    assert daemons[0].pipeline.head.speculation.stats.drafted > 0


async def test_a_speculative_request_crosses_a_dead_stage_with_the_undisturbed_tokens(nursery, tmp_path, models,
                                                                                      reference, autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, models["target"], 3, stages=2, max_context=CONTEXT,
                                     per_daemon={i: {"speculate": "ngram"} for i in range(3)})
    chain = stage_daemons(twin, daemons)
    doomed = chain[-1]
    head = next(d for d in daemons if d is not doomed)
    got = await twin.generate(head, PROMPTS[1], max_tokens=N_TOKENS,
                              on_token=lambda n: twin.crash(doomed) if n == 6 else None)
    assert not got.error and list(got.tokens) == reference[1], got
    assert head.pipeline.head.stats["moved"] >= 1


async def test_a_moe_model_with_spread_experts_speculates_to_the_same_tokens(nursery, tmp_path_factory,
                                                                             autojump_clock):
    from models.catalog.moe_writer import SYNTHETIC_MOE, write_synthetic_moe

    root = tmp_path_factory.mktemp("moe")
    moe = write_synthetic_moe(root / "moe.gguf", SYNTHETIC_MOE["tiny"], 3, vocab=300, byte_tokenizer=True,
                              name="spec-moe")
    want = whole_model_tokens(moe, PROMPTS[:2], 16)
    twin, daemons = await twin_swarm(nursery, root / "twin", moe, 3, max_context=CONTEXT, expert_placement="spread",
                                     per_daemon={0: {"speculate": "ngram"}, 1: {"speculate": f"model:{moe}"}})
    for head in daemons[:2]:
        for ids, tokens in zip(PROMPTS[:2], want, strict=True):
            got = await twin.generate(head, ids, max_tokens=16)
            assert not got.error and list(got.tokens) == tokens, (head.name, got)
    assert daemons[1].pipeline.head.speculation.stats.accepted > 0
    assert any(d.pipeline.router.status()["layers"] for d in daemons)  # experts were asked over the network
