"""The hop-local KV rebuild without a network or a model: which stages keep a moved request's KV cache, what
each computes, and which rows it sends on (sans-IO: `swarmd.inference.head.hop_local`, `StageBook`); and what a real head
sends when it moves a request (actor transports over in-memory streams, stages that only record)."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from models.text.tokenizer import Tokenizer
from swarmd.config import Timings
from swarmd.inference.head.hop_local import SentRows, keep_positions, plan_move
from swarmd.inference.head.recovery import replay_forward
from swarmd.inference.head.service import HeadRequest, HeadService, ModelInfo
from swarmd.inference.registry import ChainStatus, Registry
from swarmd.inference.stage.book import Sampled, StageBook, Work
from swarmd.wire import Cancel, Error, Forward, Sampling, Token
from tests.tiny_vocab import write_vocab_gguf
from tests.transport.memnet import MemoryNet

HIDDEN, VOCAB = 4, 100
SAMPLING = Sampling(temperature=0.0, seed=5, max_tokens=10, stop_ids=(2,))
PROMPT = (5, 6, 7, 8)


def registry(*stages: tuple[str, int, int], epoch: int = 1) -> Registry:
    return Registry(epoch, tuple(p for p, _, _ in stages), tuple((a, b) for _, a, b in stages), {})


def test_a_standby_in_a_dead_stages_place_keeps_the_other_stages_and_the_old_attempt_is_cancelled_only_there():
    old = registry(("A", 0, 10), ("B", 10, 20), ("C", 20, 30))
    move = plan_move(old, registry(("A", 0, 10), ("SPARE", 10, 20), ("C", 20, 30)))
    assert move.hop_local and move.kept == ((0, "A"), (2, "C")) and move.cancel == ((1, "B"),)


@pytest.mark.parametrize("new", [
    registry(("A", 0, 15), ("C", 15, 30)),  # the lost blocks split between the survivors: all reload
    registry(("A", 0, 12), ("SPARE", 12, 20), ("C", 20, 30)),  # a survivor's range changed
    registry(("C", 0, 10), ("A", 10, 20), ("B", 20, 30)),  # no peer holds its hop any more
])
def test_any_other_change_of_the_chain_is_a_full_replay_cancelled_on_every_old_stage(new):
    old = registry(("A", 0, 10), ("B", 10, 20), ("C", 20, 30))
    move = plan_move(old, new)
    assert not move.hop_local and move.cancel == ((0, "A"), (1, "B"), (2, "C"))


def test_a_full_replay_can_be_forced():
    old = registry(("A", 0, 10), ("B", 10, 30))
    assert not plan_move(old, registry(("A", 0, 10), ("SPARE", 10, 30)), allowed=False).hop_local


def test_a_stage_keeps_what_the_history_covers_less_the_last_position_and_no_more_than_the_rows_it_kept():
    assert keep_positions(12, None, 12) == 11  # the last stage samples from the last position: computed again
    assert keep_positions(13, None, 12) == 11  # ahead of the head's history (a token the head has not seen)
    assert keep_positions(9, 9, 12) == 9  # behind: positions 9..11 are computed
    assert keep_positions(9, 5, 12) == 5
    assert keep_positions(0, 0, 12) == 0


def test_sent_rows_are_kept_by_position_and_rewritten_from_where_a_step_starts():
    rows = SentRows(most=40)
    rows.put(0, np.ones((3, HIDDEN)))
    rows.put(3, np.full((20, HIDDEN), 2.0))  # grows past its first capacity
    rows.put(22, np.full((1, HIDDEN), 3.0))  # position 22 computed again
    assert rows.length == 23 and rows.upto(23)[22, 0] == 3.0 and rows.upto(23)[21, 0] == 2.0
    rows.put(23, np.ones((10, HIDDEN)))  # doubling (to 64) would pass the context (40): it stops there
    assert rows.capacity == 40 and rows.length == 33
    rows.truncate(4)
    assert rows.length == 4
    with pytest.raises(ValueError):
        rows.upto(5)
    with pytest.raises(ValueError):
        rows.put(6, np.ones((1, HIDDEN)))  # a gap


def out_rows(hop: int, work: Work) -> np.ndarray:
    """A stand-in for a stage's output: row p says (hop, position), so rows can be traced along the chain."""
    pos = np.arange(work.start_pos, work.start_pos + work.rows, dtype=np.float32)
    return np.stack([pos, np.full_like(pos, hop), pos, pos], axis=1)


class Chain:
    """Three stage books run in turn like the daemons would, a step at a time."""

    def __init__(self) -> None:
        self.books = [StageBook(hop, 3, 64, VOCAB) for hop in range(3)]
        self.works: list[list[Work]] = [[], [], []]

    def run(self, hop: int, msg: Forward | Token) -> list:
        book = self.books[hop]
        work = book.on_token(msg, 1.0) if isinstance(msg, Token) else book.on_forward(msg, 1.0)
        self.works[hop].append(work)
        output = Sampled(40 + work.step) if book.is_last else out_rows(hop, work)
        return book.complete(work, output, next_peer=f"S{hop + 1}", first_peer="S0", now=2.0)

    def step(self, msg: Forward | Token, *, upto: int = 3) -> int:
        """Run `msg` down the chain from its hop to stage `upto` - 1; the token sampled, if it got that far."""
        hop = msg.hop if isinstance(msg, Forward) else 0
        while hop < upto:
            outs = self.run(hop, msg)
            if self.books[hop].is_last:
                return outs[-1].msg.token
            msg, hop = outs[0].msg, hop + 1
        return -1


def undisturbed_start(chain: Chain, decode_steps: int) -> list[int]:
    """Prefill the prompt and run `decode_steps` decode steps under attempt 0 ("req"): the tokens."""
    first = Forward("req", 0, 0, 0, "H", tokens=replay_forward("req", 0, "H", PROMPT, [], SAMPLING, 1,
                                                               prompt_scores=False).tokens, sampling=SAMPLING)
    tokens = [chain.step(first)]
    for _ in range(decode_steps):
        tokens.append(chain.step(Token("req", len(tokens) - 1, tokens[-1])))
    return tokens


def test_after_a_standby_takes_stage_1_only_it_computes_the_history_and_the_others_compute_the_last_position():
    chain = Chain()
    tokens = undisturbed_start(chain, 3)  # positions 0..6 in every cache; token of step 3 sampled
    chain.books[1] = StageBook(1, 3, 64, VOCAB)  # stage 1 died: the spare holds nothing of the request
    replay = replay_forward("req", 1, "H", PROMPT, tokens, SAMPLING, 2, prompt_scores=False, resume_of="req")
    total = len(PROMPT) + len(tokens)  # 8 positions; the next token is step 4's
    outs = chain.run(0, replay)
    w0 = chain.works[0][-1]
    assert (w0.adopt, w0.start_pos, list(w0.data)) == ("req", total - 1, [tokens[-1]])
    sent = outs[0].msg
    assert (sent.request_id, sent.step, sent.hop, sent.start_pos, sent.resume_of) == ("req.r1", 4, 1, 0, "req")
    rows = sent.hidden.to_array()
    assert rows.shape == (total, HIDDEN) and list(rows[:, 0]) == list(range(total))  # kept rows, then the new one

    outs = chain.run(1, sent)
    w1 = chain.works[1][-1]
    assert (w1.adopt, w1.start_pos, w1.rows) == ("", 0, total)  # the new stage rebuilds every position
    outs = chain.run(2, outs[0].msg)
    w2 = chain.works[2][-1]
    assert (w2.adopt, w2.start_pos, w2.rows, w2.step) == ("req", total - 1, 1, 4)
    assert [(o.msg.request_id, o.msg.step, o.msg.hop) for o in outs] == [("req.r1", 4, 0), ("req.r1", 4, 1)]
    assert all("req" not in b.requests for b in chain.books)  # adopted, not held twice
    # the chain goes on under the new id, each cache one position further
    chain.step(Token("req.r1", 4, outs[0].msg.token))
    assert [b.requests["req.r1"].position for b in chain.books] == [total + 1] * 3


def test_a_stage_ahead_of_the_heads_history_drops_the_positions_past_it():
    chain = Chain()
    tokens = undisturbed_start(chain, 2)
    # stage 0 ran the next step (the head has not seen its token yet) before stage 1 died
    chain.step(Token("req", 2, 77), upto=1)
    assert chain.books[0].requests["req"].position == len(PROMPT) + 3
    replay = replay_forward("req", 1, "H", PROMPT, tokens[:2], SAMPLING, 2, prompt_scores=False, resume_of="req")
    (out,) = chain.run(0, replay)
    assert chain.works[0][-1].start_pos == len(PROMPT) + 1 and out.msg.hidden.shape == (len(PROMPT) + 2, HIDDEN)


def test_a_stage_whose_old_attempt_is_busy_or_absent_computes_every_position():
    chain = Chain()
    tokens = undisturbed_start(chain, 1)
    chain.books[0].on_token(Token("req", 1, tokens[-1]), 1.0)  # with the model now
    replay = replay_forward("req", 1, "H", PROMPT, tokens, SAMPLING, 2, prompt_scores=False, resume_of="req")
    work = chain.books[0].on_forward(replay, 1.5)
    assert (work.adopt, work.start_pos, work.rows) == ("", 0, len(PROMPT) + 2)
    assert not chain.books[0].cancel("req") and chain.books[0].requests["req"].cancelled  # freed once done
    fresh = StageBook(0, 3, 64, VOCAB)
    work = fresh.on_forward(replay_forward("req", 2, "H", PROMPT, tokens, SAMPLING, 2, prompt_scores=False,
                                           resume_of="req.r1"), 1.0)
    assert (work.adopt, work.start_pos) == ("", 0)


# --- the head ---------------------------------------------------------------------------------------------------

CHAIN = registry(("A", 0, 10), ("B", 10, 20), ("C", 20, 30))
WITH_SPARE = registry(("A", 0, 10), ("SPARE", 10, 20), ("C", 20, 30), epoch=2)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_gguf(write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "vocab.gguf", pre="gpt2"))


class RecordingChain:
    """Stage peers that take every Forward and Cancel and say nothing; the plan the head sees is `now`."""

    def __init__(self) -> None:
        self.now = CHAIN
        self.got: list[tuple[str, Forward | Cancel]] = []
        self._more = trio.Event()

    async def start(self, nursery: trio.Nursery, tokenizer: Tokenizer, *, hop_local: bool = True) -> HeadService:
        net = MemoryNet(nursery)
        for peer in ("A", "B", "C", "SPARE"):
            transport = await net.add(peer)

            async def take(sender: str, msg: Forward | Cancel, peer: str = peer) -> None:
                self.got.append((peer, msg))
                self._more.set()
                self._more = trio.Event()

            transport.route(Forward, take)
            transport.route(Cancel, take)
        info = ModelInfo("tiny", tokenizer, 64, tokenizer.vocab_size)
        head = HeadService("head", await net.add("head"), chain=lambda: ChainStatus(True, "ready"),
                           registry=lambda: self.now, timings=Timings(), load_model=lambda: info, hop_local=hop_local)
        await nursery.start(head.run)
        return head

    async def forward_of(self, request_id: str) -> Forward:
        with trio.fail_after(10):
            while not (sent := [m for _, m in self.got if isinstance(m, Forward) and m.request_id == request_id]):
                await self._more.wait()
        return sent[0]

    async def cancels_of(self, request_id: str, n: int) -> list[str]:
        """The peers told to cancel `request_id`, once `n` have been."""
        with trio.fail_after(10):
            while len(peers := sorted(p for p, m in self.got if isinstance(m, Cancel) and m.request_id == request_id)) < n:
                await self._more.wait()
        return peers


async def test_a_head_resumes_on_the_stages_that_stay_and_cancels_only_on_the_one_replaced(nursery, tokenizer):
    chain = RecordingChain()
    head = await chain.start(nursery, tokenizer)
    async with head.open(HeadRequest((5, 6, 7), 4)) as handle:
        rid = handle.request_id
        await chain.forward_of(rid)
        chain.now = WITH_SPARE  # the spare took stage 1's place
        resume = await chain.forward_of(f"{rid}.r1")
        assert (resume.resume_of, resume.step, resume.start_pos, list(resume.tokens.to_array())) == (rid, 0, 0, [5, 6, 7])
        assert await chain.cancels_of(rid, 1) == ["B"]
        # a stage that cannot continue the attempt: the next move replays everything and cancels everywhere
        await trio.testing.wait_all_tasks_blocked(0.05)  # the first move ends once stage 0 has acked its replay
        assert not handle.moving
        assert head.on_error(Error("resume_failed", "no slot", request_id=f"{rid}.r1", step=0, hop=2))
        replay = await chain.forward_of(f"{rid}.r2")
        assert replay.resume_of == "" and await chain.cancels_of(f"{rid}.r1", 3) == ["A", "C", "SPARE"]
        assert [r.kept_hops for r in handle.recoveries] == [(0, 2), ()]
        assert await chain.cancels_of(rid, 1) == ["B"]  # still: the stages that stayed kept it until the resume


async def test_a_head_told_to_replay_in_full_cancels_the_old_attempt_on_every_old_stage(nursery, tokenizer):
    chain = RecordingChain()
    head = await chain.start(nursery, tokenizer, hop_local=False)
    async with head.open(HeadRequest((5, 6, 7), 4)) as handle:
        rid = handle.request_id
        await chain.forward_of(rid)
        chain.now = WITH_SPARE
        assert (await chain.forward_of(f"{rid}.r1")).resume_of == ""
        assert await chain.cancels_of(rid, 3) == ["A", "B", "C"]
