"""A head whose chain goes silent ends the request with a timeout that says where the request was.

Real head and actor transports over in-memory streams; stage 0 is an actor that takes every frame and never
answers (as a stage stuck in its model would). No model runs: the head needs only a tokenizer.
"""

from __future__ import annotations

import re

import pytest
import trio

from models.text.tokenizer import Tokenizer
from swarmd.config import Timings
from swarmd.inference.head.service import HeadRequest, HeadService, ModelInfo
from swarmd.inference.head.session import Failed
from swarmd.inference.registry import ChainStatus, Registry
from swarmd.net.identity import short_id
from swarmd.wire.messages import Forward
from tests.tiny_vocab import write_vocab_gguf
from tests.transport.memnet import MemoryNet

STAGE = "12D3KooWsilentstage0xYzAbC"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_gguf(write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "vocab.gguf", pre="gpt2"))


READY = ChainStatus(True, "plan epoch 3: 1 stage ready")
GONE = ChainStatus(False, "waiting for a new plan: stage 0 gone", gone=frozenset({STAGE}))


async def silent_chain_head(nursery: trio.Nursery, tokenizer: Tokenizer, timings: Timings, *,
                            dies_when_it_takes_the_prompt: bool = False) -> HeadService:
    """A head whose one-stage chain takes the prompt and says nothing (and then, if asked, is gone)."""
    net = MemoryNet(nursery)
    stage = await net.add(STAGE)
    taken: list[Forward] = []

    async def take_and_say_nothing(peer: str, msg: Forward) -> None:
        taken.append(msg)

    stage.route(Forward, take_and_say_nothing)
    registry = Registry(3, (STAGE,), ((0, 4),), {"stage-0": STAGE})
    info = ModelInfo("tiny", tokenizer, 64, tokenizer.vocab_size)
    head = HeadService("head", await net.add("head"), chain=lambda: GONE if taken and dies_when_it_takes_the_prompt else READY,
                       registry=lambda: registry, timings=timings, load_model=lambda: info)
    await nursery.start(head.run)
    return head


async def test_a_silent_chain_ends_the_request_with_a_timeout_naming_the_chain(nursery, tokenizer):
    head = await silent_chain_head(nursery, tokenizer, Timings(first_token_timeout=0.3, token_timeout=0.3))
    async with head.open(HeadRequest(tuple(tokenizer.encode("hello")), 4)) as handle:
        events = [ev async for ev in handle]
    [failed] = events
    assert isinstance(failed, Failed) and failed.code == "timeout"
    assert "for 0 s waiting for the first token" in failed.message
    assert f"attempt 0 on plan epoch 3: {short_id(STAGE)}" in failed.message
    assert head.stats["failed"] == 1


async def test_a_request_whose_stage_is_gone_and_never_replaced_says_what_its_move_waits_for(nursery, tokenizer):
    head = await silent_chain_head(nursery, tokenizer, Timings(first_token_timeout=1.0, token_timeout=1.0,
                                                               ready_timeout=60.0),
                                   dies_when_it_takes_the_prompt=True)
    async with head.open(HeadRequest(tuple(tokenizer.encode("hello")), 4)) as handle:
        events = [ev async for ev in handle]
    [failed] = events
    assert isinstance(failed, Failed) and failed.code == "timeout"
    assert re.search(r"moving for \d s \(waiting for a new plan: stage 0 gone\), waiting: waiting for a new plan",
                     failed.message), failed.message
    assert head.stats["moved"] == 1
