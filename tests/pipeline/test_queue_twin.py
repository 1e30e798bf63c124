"""Under load, on whole daemons in one process (`swarmd.testing.twin`: the daemons' own code on the in-memory
network, in virtual time), each stage holding 2 requests at once: many more requests than that wait their turn
at their head and each ends with the tokens it gets alone; a full queue refuses with a time to retry and nothing
else fails; one client's burst does not hold up another client's request; a stage's crash neither loses nor
hangs a queued request. Real `swarmd join` processes under the same load: `test_daemons_queue.py`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import trio

from swarmd.inference.head.service import HeadError, HeadRequest
from swarmd.inference.head.session import Failed, Finished, TokenOut
from swarmd.testing.twin import TwinDaemon
from tests.swarm.tiny_model import write_tiny_llama
from tests.twin_swarm import stage_daemons, twin_swarm

pytestmark = pytest.mark.slow  # tinygrad runs the tiny model's steps

CONTEXT = 128
N_TOKENS = 6
SLOTS = 2  # --max-requests: each stage holds at most this many requests at once (its memory allows as many)


def settings(n: int, **first: int) -> dict[int, dict[str, int]]:
    """Each of `n` daemons' own settings: SLOTS KV slots, and `first` for the first one (the memory limit stays
    the twin's, sized for a few more requests)."""
    return {i: {"max_requests": SLOTS, **(first if i == 0 else {})} for i in range(n)}
PROMPTS = [[(11 * i + 5 * k) % 280 + 3 for k in range(3 + i % 5)] for i in range(24)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", n_blocks=6, vocab=300,
                            byte_tokenizer=True, scale=0.5)


@pytest.fixture(scope="module")
def reference(model) -> list[tuple[int, ...]]:
    """Each prompt's greedy continuation by the model run whole, alone."""
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
        out.append(tuple(gen.token_ids))
    return out


@dataclass
class Asked:
    tokens: tuple[int, ...] = ()
    code: str = ""  # "" when it finished; else its error code
    message: str = ""
    retry_after: int | None = None
    first_token_at: float | None = None  # virtual time


async def ask(head: TwinDaemon, ids: list[int], client: str) -> Asked:
    """A request of `client` as the HTTP routes make it: a place in the head's queue, its turn, its tokens."""
    service = head.pipeline.head
    try:
        turn = service.admit(client)
    except HeadError as e:
        return Asked(code=e.code, message=e.message, retry_after=e.retry_after)
    got = Asked()
    tokens: list[int] = []
    try:
        async with service.open(HeadRequest(tuple(ids), N_TOKENS), turn=turn) as handle:
            async for event in handle:
                if isinstance(event, TokenOut):
                    if not tokens:
                        got.first_token_at = trio.current_time()
                    tokens.append(event.token_id)
                elif isinstance(event, Failed):
                    got.code, got.message = event.code, event.message
                    break
                elif isinstance(event, Finished):
                    break
    except HeadError as e:
        got.code, got.message, got.retry_after = e.code, e.message, e.retry_after
    got.tokens = tuple(tokens)
    return got


async def at_once(requests: list[tuple[TwinDaemon, list[int], str]], within: float = 300.0) -> list[Asked]:
    """Every request sent together (in list order, no time between them); their outcomes in that order."""
    out: list[Asked | None] = [None] * len(requests)

    async def one(i: int) -> None:
        head, ids, client = requests[i]
        out[i] = await ask(head, ids, client)

    with trio.fail_after(within):  # none hangs
        async with trio.open_nursery() as n:
            for i in range(len(requests)):
                n.start_soon(one, i)
    return [a for a in out if a is not None]


class Peaks(trio.abc.Instrument):
    """The most requests queued at a head and held by each stage, looked at after every step of every task."""

    def __init__(self, daemons: list[TwinDaemon]) -> None:
        self.daemons = daemons
        self.queued = 0
        self.held: dict[str, int] = {}  # peer id -> most requests its stage held at once
        self.slots: dict[str, int] = {}

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        for d in self.daemons:
            if not d.alive or d.pipeline is None:
                continue
            self.queued = max(self.queued, d.pipeline.head.admission.queue.depth)
            book = d.pipeline.stage.book
            if book is not None:
                self.held[d.peer_id] = max(self.held.get(d.peer_id, 0), len(book.requests))
                self.slots[d.peer_id] = book.slots


async def test_eight_times_the_slots_at_once_all_finish_each_with_its_answer_alone(nursery, tmp_path, model,
                                                                                  reference, autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, model, 3, max_context=CONTEXT, per_daemon=settings(3))
    peaks = Peaks(daemons)
    trio.lowlevel.add_instrument(peaks)
    try:
        got = await at_once([(daemons[i % 3], ids, f"client-{i}") for i, ids in enumerate(PROMPTS)])
    finally:
        trio.lowlevel.remove_instrument(peaks)
    assert [(a.code, a.message) for a in got] == [("", "")] * len(PROMPTS)
    assert [a.tokens for a in got] == reference  # queued or not, batched or not: each its greedy answer alone
    stages = stage_daemons(twin, daemons)
    assert {peaks.slots[d.peer_id] for d in stages} == {SLOTS}
    assert all(peaks.held[d.peer_id] <= SLOTS for d in stages)  # never more than its KV slots
    assert max(peaks.held.values()) == SLOTS and peaks.queued >= 4  # the slots were full, and the rest waited
    await trio.sleep(2 * twin.timings.heartbeat_interval)  # the stages' next heartbeats say what they hold now
    for d in daemons:
        status = d.pipeline.head.admission.status()
        assert status["queued"] == status["running"] == status["refused"] == 0  # nothing left behind
        assert all(s["slots"] == SLOTS and s["used"] == 0 for s in status["stages"]), status["stages"]
    assert sum(d.pipeline.head.stats["finished"] for d in daemons) == len(PROMPTS)


async def test_a_full_queue_refuses_with_a_time_to_retry_and_every_request_it_took_finishes(nursery, tmp_path, model,
                                                                                           reference, autojump_clock):
    _, daemons = await twin_swarm(nursery, tmp_path, model, 3, max_context=CONTEXT,
                                  per_daemon=settings(3, max_queued=4))
    got = await at_once([(daemons[0], ids, f"client-{i}") for i, ids in enumerate(PROMPTS[:16])])
    refused = [a for a in got if a.code]
    assert refused and all(a.code == "queue_full" for a in refused)  # busy is never a 503, nor a failure
    assert all(a.retry_after is not None and a.retry_after >= 1 and "--max-queued 4" in a.message for a in refused)
    assert all(not a.tokens for a in refused)
    took = [(a, want) for a, want in zip(got, reference, strict=False) if not a.code]
    assert len(took) >= 4 + SLOTS  # the queue's places and the chain's slots
    assert all(a.tokens == want for a, want in took)
    assert daemons[0].pipeline.head.admission.status()["refused"] == len(refused)
    assert all(d.alive for d in daemons)


async def test_one_clients_burst_does_not_hold_up_another_clients_single_request(nursery, tmp_path, model,
                                                                                reference, autojump_clock):
    _, daemons = await twin_swarm(nursery, tmp_path, model, 3, max_context=CONTEXT, per_daemon=settings(3))
    head = daemons[0]
    burst = [(head, ids, "burst") for ids in PROMPTS[:16]]
    got = await at_once([*burst, (head, PROMPTS[16], "single")])  # the single request is sent last
    assert [a.code for a in got] == [""] * 17 and got[-1].tokens == reference[16]
    single = got[-1].first_token_at
    before = [a for a in got[:-1] if a.first_token_at is not None and a.first_token_at < single]
    assert len(before) <= 2 * SLOTS  # it waited for at most one turn of the burst, not for all 16


async def test_a_stage_killed_while_requests_wait_ends_none_without_its_tokens_or_a_clear_error(
        nursery, tmp_path, model, reference, autojump_clock):
    twin, daemons = await twin_swarm(nursery, tmp_path, model, 4, stages=3, max_context=CONTEXT,
                                         per_daemon=settings(4))
    stages = stage_daemons(twin, daemons)
    heads = [d for d in daemons if d is not stages[1]]
    killed = trio.Event()

    async def kill_once_queued() -> None:
        while sum(d.pipeline.head.admission.queue.depth for d in heads) < 8:  # noqa: ASYNC110 - a status snapshot
            await trio.sleep(0.01)
        twin.crash(stages[1])
        killed.set()

    nursery.start_soon(kill_once_queued)
    got = await at_once([(heads[i % 3], ids, f"client-{i}") for i, ids in enumerate(PROMPTS)])
    assert killed.is_set()
    for a, want in zip(got, reference, strict=True):
        assert a.tokens == want or (a.code and a.message), a  # its tokens, or a clear error: none hangs
    # a request still queued when the stage died kept its place and ran on the chain that replaced it
    errors = Counter(f"{a.code}: {a.message}" for a in got if a.code)
    assert sum(errors.values()) <= 2 * SLOTS, errors
    assert all(d.alive for d in heads)
