"""The head's queue driven by trio (`Admission`), against a chain whose slots the test sets: requests start when
every stage has room, in turn; a client that goes away leaves the line; a swarm that cannot serve is a 503,
a full queue a 429. Virtual time: no real waiting."""

from __future__ import annotations

import pytest
import trio

from swarmd.config import Timings
from swarmd.inference.head.admission import Admission, NotReady, QueueFull
from swarmd.inference.head.slots import StageSlots
from swarmd.inference.registry import ChainStatus, Registry

REGISTRY = Registry(1, ("s0", "s1"), ((0, 2), (2, 4)), {"stage-0": "s0", "stage-1": "s1"})


class Chain:
    """What the swarm says: whether the chain is ready, and each stage's gossiped slots."""

    def __init__(self, slots: int) -> None:
        self.status = ChainStatus(True, "plan epoch 1: 2 stages ready")
        self.slots = {"s0": StageSlots(slots, 0, 0), "s1": StageSlots(slots * 2, 0, 0)}

    def admission(self, max_queued: int = 8, **timings: float) -> Admission:
        return Admission(chain=lambda: self.status, registry=lambda: REGISTRY, capacity=lambda: self.slots,
                         timings=Timings(**timings), max_queued=max_queued)


async def test_requests_start_in_turn_as_slots_free_up(nursery, autojump_clock):
    chain = Chain(slots=2)
    admission = await nursery.start(chain.admission().run)
    started: list[str] = []
    turns = {}

    async def request(name: str) -> None:
        turns[name] = admission.admit(name[0])
        await admission.wait_turn(turns[name])
        started.append(name)

    for name in ("a1", "a2", "a3", "a4", "b1"):
        nursery.start_soon(request, name)
        await trio.sleep(0.01)
    await trio.sleep(5)
    assert started == ["a1", "a2"] and admission.queue.depth == 3  # two slots on stage 0
    admission.close(turns["a1"])
    await trio.sleep(0.2)
    assert started == ["a1", "a2", "a3"]  # a's turn (it was first in line), then b's
    chain.slots["s0"] = StageSlots(3, 2, 1)  # the stage reports a slot more (another head's request ended)
    await trio.sleep(0.2)
    assert started == ["a1", "a2", "a3", "b1"] and admission.queue.depth == 1  # b's one before a's fourth
    assert admission.status()["stages"] == [{"hop": 0, "peer_id": "s0", "slots": 3, "used": 3},
                                            {"hop": 1, "peer_id": "s1", "slots": 4, "used": 3}]
    assert admission.status()["queued"] == 1 and admission.status()["running"] == 3


async def test_a_client_that_goes_away_leaves_the_line(nursery, autojump_clock):
    admission = await nursery.start(Chain(slots=1).admission().run)
    first = admission.admit("a")
    await admission.wait_turn(first)
    waiting = admission.admit("b")
    with trio.move_on_after(10):  # the client hangs up while it waits
        await admission.wait_turn(waiting)
    assert admission.queue.depth == 1
    admission.close(waiting)
    assert admission.queue.depth == 0 and admission.queue.running == 1


async def test_a_chain_that_stays_unready_is_a_503_and_a_full_queue_a_429(nursery, autojump_clock):
    chain = Chain(slots=1)
    admission = await nursery.start(chain.admission(max_queued=2, ready_timeout=30).run)
    chain.status = ChainStatus(False, "waiting for a new plan: stage 1 gone")
    turn = admission.admit("a")
    said: list[str] = []

    async def on_wait(detail: str) -> None:
        said.append(detail)

    with pytest.raises(NotReady) as e:
        await admission.wait_turn(turn, on_wait)
    assert e.value.code == "not_ready" and "stage 1 gone" in e.value.message and said == [chain.status.detail]
    admission.admit("a")
    with pytest.raises(QueueFull) as full:
        admission.admit("a")  # two wait (one gave up, but its place is held until closed)
    assert full.value.retry_after >= 1 and "--max-queued 2" in full.value.message


async def test_a_request_pushed_out_of_a_full_queue_is_told_to_retry(nursery, autojump_clock):
    chain = Chain(slots=1)
    admission = await nursery.start(chain.admission(max_queued=2).run)
    await admission.wait_turn(admission.admit("x"))  # holds the only slot
    burst = [admission.admit("a"), admission.admit("a")]
    newcomer = admission.admit("b")  # a held both places: its newest gives one up
    with pytest.raises(QueueFull):
        await admission.wait_turn(burst[1])
    assert admission.queue.ahead_of(newcomer.ticket.id) == 1


async def test_a_request_put_back_by_a_busy_stage_waits_until_that_stage_reports_room(nursery, autojump_clock):
    chain = Chain(slots=2)
    admission = await nursery.start(chain.admission().run)
    turn = admission.admit("a")
    await admission.wait_turn(turn)
    admission.requeue(turn, "s0")  # s0 had no slot after all: other heads' requests took them since its report
    with trio.move_on_after(0.5):
        await admission.wait_turn(turn)
    assert not turn.granted.is_set() and admission.queue.depth == 1  # not sent straight back to be refused
    chain.slots["s0"] = StageSlots(2, 1, 1)  # its next report: one slot free
    with trio.fail_after(0.5):
        assert await admission.wait_turn(turn) == REGISTRY


async def test_status_shows_the_stages_latest_reports_with_no_request_waiting(nursery, autojump_clock):
    chain = Chain(slots=2)
    admission = await nursery.start(chain.admission().run)
    chain.slots["s0"] = StageSlots(2, 2, 1)  # another head's two requests hold stage 0
    turn = admission.admit("a")
    with trio.move_on_after(5):
        await admission.wait_turn(turn)
    assert admission.status()["stages"][0]["used"] == 2
    admission.close(turn)
    chain.slots["s0"] = StageSlots(2, 0, 2)  # they ended; nothing waits here any more
    assert admission.status()["stages"][0]["used"] == 0


async def test_a_client_is_the_openai_user_field_else_its_address():
    import httpx
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from swarmd.api.app import Api
    from swarmd.api.turns import client_key

    async def key(request: Request) -> JSONResponse:
        return JSONResponse(client_key(request, await request.json()))

    api = Api()
    api.add_route("/v1/completions", key, methods=("POST",))
    async with trio.open_nursery() as nursery:
        url = await nursery.start(api.serve, "127.0.0.1:0")
        async with httpx.AsyncClient(base_url=url) as client:
            keys = [(await client.post("/v1/completions", json=body)).json()
                    for body in ({"user": "alice"}, {"user": "alice", "prompt": "x"}, {"user": "bob"}, {"user": ""},
                                 {"user": 7}, {}, ["not", "an", "object"], {"user": "x" * 500})]
        nursery.cancel_scope.cancel()
    assert keys[:3] == ["user:alice", "user:alice", "user:bob"]
    assert keys[3:7] == ["addr:127.0.0.1"] * 4  # no usable user: one client per address
    assert keys[7] == "user:" + "x" * 128
