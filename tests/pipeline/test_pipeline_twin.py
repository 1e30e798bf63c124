"""A model split over 2, 3 and 6 whole daemons in one process (the in-memory twin, virtual time) gives, token for
token, what it gives run whole by `models.generate` (the loop behind `swarmd run`), prompts at once included.
SmolLM2 over real processes is `test_daemons_pipeline.py`."""

from __future__ import annotations

import pytest
import trio

from tests.swarm.tiny_model import write_tiny_llama
from tests.twin_swarm import stage_daemons, twin_swarm

pytestmark = pytest.mark.slow  # tinygrad compiles each stage's kernels on first use

CONTEXT = 128
N_TOKENS = 8
PROMPTS = ([40, 41, 42, 43], [7, 100, 7, 100, 9], [250, 3], [1, 2, 3, 4, 5, 6, 7])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", n_blocks=6, vocab=300,
                            byte_tokenizer=True, scale=0.5)


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    """Each prompt's greedy continuation by the model run whole."""
    from models.generate import generate
    from models.sampling import SamplingParams
    from models.stage import SERVING_NUMERICS, StageModel
    from models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    whole = StageModel.from_gguf(model, max_context=CONTEXT, max_requests=1, numerics=SERVING_NUMERICS)
    out = []
    for ids in PROMPTS:
        gen = generate(whole, tok, ids, SamplingParams(max_tokens=N_TOKENS))
        for _ in gen:
            pass
        out.append(gen.token_ids)
    return out


@pytest.mark.parametrize("n", [2, 3, 6])
async def test_n_daemons_generate_token_for_token_what_swarmd_run_generates(n, nursery, tmp_path, model, reference,
                                                                           autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, model, n, max_context=CONTEXT)
    assert len(stage_daemons(twin, daemons)) == n
    for i, (ids, want) in enumerate(zip(PROMPTS, reference, strict=True)):
        got = await twin.generate(daemons[i % n], ids, max_tokens=N_TOKENS)
        assert not got.error and list(got.tokens) == want, (n, i, got)
    results = {}

    async def one(i: int) -> None:
        results[i] = await twin.generate(daemons[i % n], PROMPTS[i], max_tokens=N_TOKENS)

    async with trio.open_nursery() as at_once:  # the prompts at once: each equals its single request's output
        for i in range(len(PROMPTS)):
            at_once.start_soon(one, i)
    assert [list(results[i].tokens) for i in range(len(PROMPTS))] == reference
    assert max(d.pipeline.status()["stage"]["largest_batch"] for d in stage_daemons(twin, daemons)) >= 2
