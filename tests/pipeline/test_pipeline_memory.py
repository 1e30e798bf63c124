"""A whole pipeline in one process: real stage and head actors, real actor transports over in-memory streams,
real tinygrad stages of a tiny seeded-random Llama (so kernels compile in seconds), a real byte-level tokenizer.

Three stages (s0, s1, s2) and a daemon with no stage (h) that heads requests too. Every result is compared with
the same model run whole in one process by `models.generate`, the loop behind `swarmd run`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import trio

from models.generate import generate
from models.sampling import SamplingParams
from models.stage import StageInput, StageModel
from models.text.tokenizer import Tokenizer
from swarmd.config import Timings
from swarmd.inference.compute import ComputeThread
from swarmd.inference.head.service import HeadError, HeadRequest, HeadService, ModelInfo
from swarmd.inference.head.session import Failed, Finished, PromptScores, TokenOut
from swarmd.inference.pipeline import install_actor_routes
from swarmd.inference.registry import ChainStatus, Registry
from swarmd.inference.stage.actor import Loaded, StageActor
from tests.tiny_vocab import write_vocab_gguf
from tests.transport.memnet import MemoryNet

pytestmark = pytest.mark.slow  # compiles the tiny model's kernels (about 15 s on a cold cache)

SEED = 11
SPLITS = ((0, 2), (2, 3), (3, 4))
CONTEXT = 96
SLOTS = 2
PROMPTS = ("the quick brown fox", "hello world! hello")


@dataclass
class Tiny:
    tokenizer: Tokenizer
    config: object
    stages: list[StageModel]
    whole: StageModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    from tinygrad.llm.model import TransformerConfig

    path = write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "vocab.gguf", pre="gpt2")
    tokenizer = Tokenizer.from_gguf(path)
    config = TransformerConfig(num_blocks=4, dim=64, hidden_dim=128, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                               vocab_size=tokenizer.vocab_size, head_dim=16, rope_theta=10000.0, rope_dim=16,
                               v_head_dim=16, max_context=CONTEXT)
    stages = [StageModel.random(config, SEED, a, b, max_context=CONTEXT, max_requests=SLOTS) for a, b in SPLITS]
    whole = StageModel.random(config, SEED, 0, 4, max_context=CONTEXT, max_requests=1)
    return Tiny(tokenizer, config, stages, whole)


def reference(tiny: Tiny, prompt: str, max_tokens: int, **params) -> list[int]:
    """The tokens `swarmd run` would generate with the whole model in one process."""
    ids = tiny.tokenizer.encode(prompt)

    def run() -> list[int]:
        gen = generate(tiny.whole, tiny.tokenizer, ids, SamplingParams(max_tokens=max_tokens, **params))
        for _ in gen:
            pass
        return gen.token_ids

    return run()  # on the test's thread while no stage computes


class MemorySwarm:
    """s0..s2 hold the stages, h holds none; each has a stage actor, a head and a transport."""

    def __init__(self, net: MemoryNet, tiny: Tiny) -> None:
        self.net, self.tiny = net, tiny
        self.registry = Registry(1, ("s0", "s1", "s2"), SPLITS, {"stage-0": "s0", "stage-1": "s1", "stage-2": "s2"})
        self.heads: dict[str, HeadService] = {}
        self.stages: dict[str, StageActor] = {}
        self.chain = ChainStatus(True, "plan epoch 1: 3 stages ready")  # what the swarm says of its chain
        self.compute = ComputeThread()  # one for the three stages, as if they shared a process
        self.posted: dict[str, list[list[tuple]]] = {}  # per daemon, each post_all: (peer, message tag, hop) of each

    async def start(self, nursery: trio.Nursery) -> MemorySwarm:
        info = ModelInfo("tiny", self.tiny.tokenizer, CONTEXT, self.tiny.tokenizer.vocab_size)
        timings = Timings(first_token_timeout=120.0, token_timeout=60.0)
        for name in ("s0", "s1", "s2", "h"):
            transport = await self.net.add(name)
            hop = self.registry.hop_of(name)
            loaded = None if hop is None else Loaded(self.tiny.stages[hop], hop, self.registry)
            stage = StageActor(lambda loaded=loaded: loaded, compute=self.compute, max_context=CONTEXT, wire_dtype=None,
                               idle_timeout=600, post_all=self._recording(name, transport.post_all))
            head = HeadService(name, transport, chain=lambda: self.chain, registry=lambda: self.registry,
                               timings=timings, load_model=lambda: info)
            await nursery.start(stage.run)
            await nursery.start(head.run)
            install_actor_routes(transport, stage, head, peer_id=name)
            self.heads[name], self.stages[name] = head, stage
        return self

    def _recording(self, name: str, post_all):
        async def post(sends) -> None:
            self.posted.setdefault(name, []).append([(s.peer, s.msg.TAG, getattr(s.msg, "hop", None)) for s in sends])
            await post_all(sends)

        return post

    def request(self, prompt: str, max_tokens: int, **kw) -> HeadRequest:
        return HeadRequest(tuple(self.tiny.tokenizer.encode(prompt)), max_tokens, **kw)

    async def generate(self, head: str, req: HeadRequest) -> tuple[list[int], list]:
        tokens, events = [], []
        async with self.heads[head].open(req) as handle:
            async for ev in handle:
                events.append(ev)
                if isinstance(ev, TokenOut):
                    tokens.append(ev.token_id)
        return tokens, events

    async def caches_freed(self, seconds: float = 10.0) -> None:
        """Every stage's KV slots are free again (the head's Cancel reached each stage)."""
        for _ in range(int(seconds / 0.02)):
            if not any(len(m.slots) for m in self.tiny.stages):
                return
            await trio.sleep(0.02)
        raise AssertionError(f"KV slots still held: {[len(m.slots) for m in self.tiny.stages]}")


@pytest.fixture
async def swarm(nursery, tiny) -> MemorySwarm:
    swarm = await MemorySwarm(MemoryNet(nursery), tiny).start(nursery)
    yield swarm
    await swarm.caches_freed()


async def test_greedy_tokens_through_three_stages_equal_the_whole_model(swarm, tiny):
    for prompt, head in zip(PROMPTS, ("s0", "h"), strict=True):
        tokens, events = await swarm.generate(head, swarm.request(prompt, 10))
        assert tokens == reference(tiny, prompt, 10)
        assert isinstance(events[-1], Finished)
        text = "".join(e.text for e in events if isinstance(e, TokenOut | Finished))
        assert text == tiny.tokenizer.decode(tokens)


async def test_concurrent_requests_each_equal_their_single_output_and_decode_as_one_batch(swarm, tiny):
    results: dict[str, list[int]] = {}

    async def one(prompt: str, head: str) -> None:
        results[prompt] = (await swarm.generate(head, swarm.request(prompt, 12)))[0]

    async with trio.open_nursery() as nursery:
        for prompt, head in zip(PROMPTS, ("s0", "h"), strict=True):
            nursery.start_soon(one, prompt, head)
    for prompt in PROMPTS:
        assert results[prompt] == reference(tiny, prompt, 12)
    assert max(s.stats.largest_batch for s in swarm.stages.values()) == 2  # two decode steps in one forward
    # and the batch's outputs leave together, for the next stage to read at once
    assert [("s1", "forward", 1)] * 2 in swarm.posted["s0"] and [("s2", "forward", 2)] * 2 in swarm.posted["s1"]
    assert [("s0", "token", 0)] * 2 in swarm.posted["s2"]  # the next step's inputs, to stage 0
    assert all(len({hop for _, _, hop in sent}) == 1 for sent in swarm.posted["s2"])  # apart from the head's copies


async def test_seeded_sampling_gives_the_tokens_of_swarmd_run_with_that_seed(swarm, tiny):
    params = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    tokens, _ = await swarm.generate("h", swarm.request(PROMPTS[0], 10, **params))
    assert tokens == reference(tiny, PROMPTS[0], 10, **params)


async def test_a_client_that_leaves_early_frees_the_kv_cache_at_every_stage(swarm, tiny):
    async with swarm.heads["h"].open(swarm.request(PROMPTS[0], 60)) as handle:
        async for ev in handle:
            if isinstance(ev, TokenOut) and ev.step == 2:
                break
    assert swarm.heads["h"].stats["cancelled"] == 1
    await swarm.caches_freed()


async def test_a_stop_string_ends_the_request_where_it_appears(swarm, tiny):
    full = tiny.tokenizer.decode(reference(tiny, PROMPTS[1], 12))
    stop = full[5:8]
    _, events = await swarm.generate("s0", swarm.request(PROMPTS[1], 12, stop=(stop,)))
    text = "".join(e.text for e in events if isinstance(e, TokenOut | Finished))
    assert text == full[:full.index(stop)] and events[-1] == Finished("stop", events[-1].text)


async def test_a_full_kv_cache_refuses_a_new_request_clearly(swarm, tiny):
    async with swarm.heads["s0"].open(swarm.request(PROMPTS[0], 80)) as a, \
            swarm.heads["h"].open(swarm.request(PROMPTS[1], 80)) as b:
        await a.__anext__()
        await b.__anext__()  # both hold a KV slot at every stage (SLOTS == 2)
        _, events = await swarm.generate("h", swarm.request(PROMPTS[0], 4))
    assert isinstance(events[-1], Failed) and events[-1].code == "kv_cache_full"
    assert "KV cache slots" in events[-1].message


async def test_teacher_forcing_scores_every_prompt_token_as_the_whole_model_does(swarm, tiny):
    ids = tiny.tokenizer.encode("the theory of the thing: there, then")
    _, events = await swarm.generate("h", HeadRequest(tuple(ids), 0, logprobs=3, prompt_scores=True))
    (scores,) = [e for e in events if isinstance(e, PromptScores)]

    def whole_logits() -> np.ndarray:
        tiny.whole.add_request("tf")
        try:
            return tiny.whole.forward([StageInput("tf", 0, np.asarray(ids, dtype=np.int32), all_logits=True)])[0]
        finally:
            tiny.whole.free_request("tf")

    logits = whole_logits()
    x = logits.astype(np.float64)
    logp = x - x.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    want = [logp[i, ids[i + 1]] for i in range(len(ids) - 1)]
    assert np.allclose(scores.token_logprobs, want, atol=1e-4)
    assert [top[0][0] for top in scores.top] == [int(np.argmax(row)) for row in logits[:-1]]
    assert events[-1] == Finished("length")


async def test_a_request_waits_for_the_chain_saying_what_it_waits_for_then_runs(swarm, tiny, nursery):
    loading = ChainStatus(False, "plan epoch 1: loading stage 1 (blocks 2-2, s1)")
    swarm.chain = loading
    said: list[str] = []

    async def on_wait(detail: str) -> None:
        said.append(detail)

    async def ready_soon() -> None:
        await trio.sleep(0.5)
        swarm.chain = ChainStatus(True, "plan epoch 1: 3 stages ready")

    nursery.start_soon(ready_soon)
    tokens = []
    async with swarm.heads["h"].open(swarm.request(PROMPTS[0], 4), on_wait=on_wait) as handle:
        tokens = [ev.token_id async for ev in handle if isinstance(ev, TokenOut)]
    assert said == [loading.detail] and handle.timing.sent - handle.timing.opened >= 0.4
    assert tokens == reference(tiny, PROMPTS[0], 4)


async def test_a_chain_that_stays_unready_fails_the_request_after_the_deadline(swarm):
    swarm.chain = ChainStatus(False, "waiting for a new plan: stage 2 (blocks 3-3, s2) gone")
    with pytest.raises(HeadError) as e:
        async with swarm.heads["s0"].open(swarm.request(PROMPTS[0], 4), ready_timeout=0.3):
            pass
    assert e.value.status == 503 and e.value.code == "not_ready" and "stage 2 (blocks 3-3, s2) gone" in e.value.message
