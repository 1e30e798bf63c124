"""The MoE router and expert actors over real actor transports (in-memory links): one batch per node,
answers equal to the experts computed in place, a holder that cannot be reached or dies is replaced by
another holder of its experts, and experts whose every holder died wait (bounded) for a plan that
re-places them."""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio

from models.expert_shard import ExpertShard
from models.moe import ExpertCall
from swarmd.inference.compute import ComputeThread, use_a_kernel_cache_connection_per_thread
from swarmd.inference.moe.expert import ExpertActor
from swarmd.inference.moe.router import ExpertsUnavailable, MoERouter
from swarmd.observe.spans import SpanRecorder
from swarmd.transport.transport import TransportConfig
from swarmd.wire.messages import Error, ExpertBatch, ExpertResult
from tests.models.tiny_gguf import TinyMoE, TinySpec, tiny_moe_weights, write_moe_gguf
from tests.transport.memnet import MemoryNet

SPEC = TinySpec(n_blocks=2)
MOE = TinyMoE(n_experts=6, top_k=2)
BLOCK = 1
HOLDS = {"a": [0, 3], "b": [1, 4, 2], "c": [2, 5]}  # expert 2 has two holders: c first, then b
PLAN = {0: ("a",), 1: ("b",), 2: ("c", "b"), 3: ("a",), 4: ("b",), 5: ("c",)}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    use_a_kernel_cache_connection_per_thread()
    weights = tiny_moe_weights(SPEC, MOE, seed=4)
    return write_moe_gguf(tmp_path_factory.mktemp("moe") / "m.gguf", SPEC, MOE, weights)


def layer_call(rows: int = 5) -> ExpertCall:
    rng = np.random.default_rng(0)
    sel = np.array([rng.choice(6, 2, replace=False) for _ in range(rows)], np.int32)
    sel[0] = [2, 5]  # a row that needs only node c's experts
    return ExpertCall(BLOCK, rng.standard_normal((rows, SPEC.dim)).astype(np.float32), sel,
                      rng.random((rows, 2)).astype(np.float32))


async def build(nursery, gguf, config: TransportConfig | None = None, recorders: dict | None = None, *,
                plan: dict | None = None, hang: frozenset[str] = frozenset(), plan_wait: float = 60.0,
                block_the_loop: frozenset[str] = frozenset()):
    """Expert nodes a, b, c and a stage s with the router; `recorders`, if given, gets each node's
    SpanRecorder by name; `plan` (default PLAN) is read at every call, as a daemon reads its current plan;
    nodes in `hang` ack batches and never answer them (a node killed while computing); nodes in
    `block_the_loop` hold the event loop for 50 ms of wall time before each answer (as a simulation's inline
    compute does: the clock does not move meanwhile)."""
    net = MemoryNet(nursery)
    compute = ComputeThread()
    net.shards, net.hung = {}, trio.Event()

    async def hang_up(peer, msg):
        net.hung.set()
        await trio.sleep_forever()

    def blocking(handler):
        async def handle(peer, msg):
            time.sleep(0.05)  # noqa: ASYNC251 - the point: the loop is held, its clock stands still
            return await handler(peer, msg)

        return handle

    for name, experts in HOLDS.items():
        transport = await net.add(name, config)
        net.shards[name] = ExpertShard.from_gguf(gguf, {BLOCK: experts}, dtype="float32")
        actor = ExpertActor(lambda name=name: net.shards[name], compute=compute)
        if recorders is not None:
            actor.recorder = recorders[name] = SpanRecorder()
        handler = hang_up if name in hang else actor.on_batch
        transport.route(ExpertBatch, blocking(handler) if name in block_the_loop else handler)
    stage = await net.add("s", config)
    router = MoERouter(stage, lambda block: dict(PLAN if plan is None else plan), result_timeout=60.0,
                       plan_wait=plan_wait)
    if recorders is not None:
        router.recorder = recorders["s"] = SpanRecorder()
    stage.route(ExpertResult, router.on_result)
    stage.on_link_lost = router.link_lost

    async def on_error(peer, msg):
        router.on_error(msg)

    stage.route(Error, on_error)
    return net, router


async def test_one_batch_per_node_and_the_answer_of_the_experts_in_place(gguf):
    whole = ExpertShard.from_gguf(gguf, {BLOCK: range(6)}, dtype="float32")
    call = layer_call()
    want = whole(call)
    async with trio.open_nursery() as nursery:
        _, router = await build(nursery, gguf)
        got = await router.call(call)
        stats = router.layers[BLOCK]
        assert stats.messages == stats.nodes_hit == 3  # a, b and c: one ExpertBatch each for 5 rows x 2 experts
        assert sum(stats.tokens.values()) == call.sel.size
        nursery.cancel_scope.cancel()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


async def test_a_holders_latency_is_timed_on_the_event_loops_clock_not_the_wall_clock(gguf, mock_clock):
    """The replica chooser learns how long each holder takes on the event loop's clock, which it also ages its
    estimates on: in a simulation on virtual time, which holder is asked never depends on how long the process
    took. Here node c holds the loop for 50 ms of wall time before each answer while the clock stands still."""
    async with trio.open_nursery() as nursery:
        _, router = await build(nursery, gguf, block_the_loop=frozenset({"c"}))
        for _ in range(2):
            await router.call(layer_call())
        latency = router.chooser.latency
        assert latency["c"] == latency["a"] == latency["b"] < router.chooser.prior_s  # every answer took 0 s
        nursery.cancel_scope.cancel()


async def test_a_traced_request_gets_the_fan_out_on_the_router_and_the_compute_on_each_expert_node(gguf):
    call = layer_call()
    recorders: dict[str, SpanRecorder] = {}
    async with trio.open_nursery() as nursery:
        _, router = await build(nursery, gguf, recorders=recorders)
        recorders["s"].trace("r-traced")
        await router.call(call)  # no traced request among its rows: nothing recorded anywhere
        await router.call(call, {"r-traced": 7})
        nursery.cancel_scope.cancel()
    spans = recorders["s"].spans("r-traced")
    assert [n for n, *_ in spans].count("moe.fan_out") == 1
    (fan_out,) = [s for s in spans if s[0] == "moe.fan_out"]
    assert fan_out[4] | {"messages": 3} == fan_out[4] and fan_out[4]["nodes"] == 3 and fan_out[4]["step"] == 7
    calls = {s[4]["to"]: s for s in spans if s[0] == "moe.call"}
    assert sorted(calls) == ["a", "b", "c"] and all(s[4]["answered"] for s in calls.values())
    for name, (_, thread, start, end, args) in calls.items():
        assert thread == f"moe router {BLOCK}" and fan_out[2] <= start <= end <= fan_out[3]
        (batch,) = [s for s in recorders[name].spans("r-traced") if s[0] == "expert.batch"]  # the traced call's
        assert batch[4]["flow"] == args["flow"] and batch[4]["step"] == 7 and batch[4]["sender"] == "s"
        assert start <= batch[2] <= batch[3] <= end  # one clock here: the expert's part lies inside the call
        (forward,) = [s for s in recorders[name].spans("r-traced") if s[0] == "expert.forward"]
        assert batch[2] <= forward[2] <= forward[3] <= batch[3]
        assert set(forward[4]["experts"].split(",")) <= {str(e) for e in HOLDS[name]}
    assert len({s[4]["flow"] for s in calls.values()}) == 3


async def test_an_unreachable_holder_is_replaced_by_another_holder_of_its_experts(gguf):
    call = ExpertCall(BLOCK, np.ones((2, SPEC.dim), np.float32), np.array([[2, 0], [2, 3]], np.int32),
                      np.full((2, 2), 0.5, np.float32))
    want = ExpertShard.from_gguf(gguf, {BLOCK: range(6)}, dtype="float32")(call)
    async with trio.open_nursery() as nursery:
        net, router = await build(nursery, gguf, TransportConfig(send_timeout=1.0))
        net.down.add("c")
        got = await router.call(call)
        assert router.chooser.choose(PLAN[2]) == "b"  # c stays avoided: its estimate took the failure penalty
        nursery.cancel_scope.cancel()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


async def ask(router, call, got: list, answered: trio.Event) -> None:
    got.append(await router.call(call))
    answered.set()


def one_row(*experts: int) -> ExpertCall:
    return ExpertCall(BLOCK, np.ones((1, SPEC.dim), np.float32), np.array([experts], np.int32),
                      np.full((1, len(experts)), 0.5, np.float32))


async def test_a_batch_waiting_on_a_node_that_dies_goes_to_a_replica_as_soon_as_membership_says_so(gguf):
    call = one_row(2, 0)  # expert 2: c first, then b
    want = ExpertShard.from_gguf(gguf, {BLOCK: range(6)}, dtype="float32")(call)
    async with trio.open_nursery() as nursery:
        net, router = await build(nursery, gguf, hang=frozenset({"c"}))
        answered, got = trio.Event(), []
        nursery.start_soon(ask, router, call, got, answered)
        with trio.fail_after(10):
            await net.hung.wait()  # c acked the batch and computes forever
        died = trio.current_time()
        router.peer_state("c", dead=True)
        with trio.fail_after(5):
            await answered.wait()
        assert trio.current_time() - died < 2.0  # not the 60 s result timeout
        asked = router.layers[BLOCK].messages
        await router.call(call)  # the dead node is not asked again: the replica answers at once
        assert router.layers[BLOCK].messages == asked + 2 and router.waits == 0
        nursery.cancel_scope.cancel()
    np.testing.assert_allclose(got[0], want, atol=1e-5, rtol=0)


async def test_a_batch_whose_link_breaks_goes_to_a_replica_at_once_and_one_without_replica_keeps_waiting(gguf):
    replicated, alone = one_row(2, 0), one_row(5, 0)  # expert 2: c, then b; expert 5: only c
    want = ExpertShard.from_gguf(gguf, {BLOCK: range(6)}, dtype="float32")(replicated)
    async with trio.open_nursery() as nursery:
        net, router = await build(nursery, gguf, hang=frozenset({"c"}))
        answered, got = trio.Event(), []
        nursery.start_soon(ask, router, replicated, got, answered)
        lone_answered, lone = trio.Event(), []
        nursery.start_soon(ask, router, alone, lone, lone_answered)
        with trio.fail_after(10):
            await net.hung.wait()
        await trio.sleep(0.2)  # both batches acked by c, which never answers
        net.down.add("c")
        broke = trio.current_time()
        await net.break_links()
        with trio.fail_after(5):
            await answered.wait()
        assert trio.current_time() - broke < 2.0 and "c" not in router.dead  # no verdict from membership needed
        await trio.sleep(0.5)
        assert not lone_answered.is_set()  # no other holder: it waits for the retries or for membership
        nursery.cancel_scope.cancel()
    np.testing.assert_allclose(got[0], want, atol=1e-5, rtol=0)


async def test_experts_whose_only_holder_died_wait_for_the_plan_that_places_them_on_a_survivor(gguf):
    call = one_row(5, 0)  # expert 5 lives only on c
    want = ExpertShard.from_gguf(gguf, {BLOCK: range(6)}, dtype="float32")(call)
    plan = dict(PLAN)
    async with trio.open_nursery() as nursery:
        net, router = await build(nursery, gguf, plan=plan, hang=frozenset({"c"}))
        answered, got = trio.Event(), []
        nursery.start_soon(ask, router, call, got, answered)
        with trio.fail_after(10):
            await net.hung.wait()
        net.down.add("c")
        router.peer_state("c", dead=True)
        for _ in range(200):  # the step notices that c is gone (seconds on a busy machine)
            await trio.sleep(0.05)
            if router.waits:
                break
        assert not answered.is_set() and router.waits == 1  # no live holder of expert 5: waiting for a plan
        plan[5] = ("a",)  # the leader's re-plan puts expert 5 on a, which loads it a little later
        await trio.sleep(0.3)
        net.shards["a"] = ExpertShard.from_gguf(gguf, {BLOCK: [0, 3, 5]}, dtype="float32")
        with trio.fail_after(5):
            await answered.wait()
        nursery.cancel_scope.cancel()
    np.testing.assert_allclose(got[0], want, atol=1e-5, rtol=0)


async def test_an_expert_whose_only_holder_is_gone_fails_the_step_clearly_when_no_plan_replaces_it(gguf):
    async with trio.open_nursery() as nursery:
        net, router = await build(nursery, gguf, TransportConfig(send_timeout=1.0), plan_wait=0.5)
        net.down.add("c")
        with pytest.raises(ExpertsUnavailable, match=r"expert 5 of block 1 has no reachable holder and no new plan "
                                                     r"placed it on a live node within 0\.5 s"):
            await router.call(one_row(5, 0))
        nursery.cancel_scope.cancel()
