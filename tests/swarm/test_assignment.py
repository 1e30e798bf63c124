"""A node loads what the plan gives it (a real StageModel of a tiny GGUF) and reports how far it got."""

from __future__ import annotations

import pytest
import trio

from planner.plan import ModelRef, Plan, Stage
from swarmd.daemon.assignment import Assignment
from swarmd.daemon.served_model import served_model
from swarmd.inference.compute import ComputeThread
from swarmd.wire.gossip import PlanAnnouncement
from tests.swarm.swarm_helpers import peer

ME, OTHER = peer(1), peer(2)

pytestmark = pytest.mark.usefixtures("tinygrad_in_process")


@pytest.fixture
def read(monkeypatch) -> list[str]:
    """The GGUF tensors the model file's real reader reads from now on, by name, in order."""
    from models.gguf import loader as gguf_loader

    names: list[str] = []
    read_raw = gguf_loader.read_raw
    monkeypatch.setattr(gguf_loader, "read_raw", lambda header, name: names.append(name) or read_raw(header, name))
    return names


@pytest.fixture
def no_graph_cache(monkeypatch) -> None:
    """Stages that are loaded and never run: no graph cache, whose fill would capture graphs after each load."""
    monkeypatch.setenv("SWARMD_GRAPH_CACHE", "off")


def blocks_in(names: list[str]) -> list[int]:
    return sorted({int(n.split(".")[1]) for n in names if n.startswith("blk.")})


async def reaches(a: Assignment, state: str) -> None:
    for _ in range(1000):
        if a.status().state == state:
            return
        await trio.sleep(0.05)
    raise AssertionError(f"still {a.status().state}, not {state}")


async def loaded(a: Assignment, layers: tuple[int, int]):
    """The stage, once the assignment is ready with blocks `layers`."""
    for _ in range(1000):
        if a.status().state == "ready" and a.status().layers == layers:
            return a.stage
        await trio.sleep(0.05)
    raise AssertionError(f"still {a.status()}, not ready with {layers}")


def announce(epoch: int, *stages: Stage) -> PlanAnnouncement:
    return PlanAnnouncement(OTHER, 1, Plan(epoch=epoch, model=ModelRef("tiny"), stages=stages))


@pytest.mark.usefixtures("no_graph_cache")
async def test_the_assigned_blocks_are_loaded_then_released_when_the_plan_moves_them(tiny_model):
    model = served_model(str(tiny_model))
    a = Assignment(ME, model, "CPU", ComputeThread(), max_context=64, max_requests=1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            assert a.status().state == "idle"
            a.apply(announce(1, Stage(OTHER, (0, 5)), Stage(ME, (5, 8))))
            stage = await a.wait_ready()
            assert (stage.start, stage.end, stage.is_last) == (5, 8, True)
            assert a.status().to_json() == {"epoch": 1, "layers": [5, 8], "experts": {}, "state": "ready",
                                            "progress": 1.0, "error": "", "fetch": {"bytes": 0, "total": 0,
                                                                                      "rate": 0.0}}
            a.apply(announce(2, Stage(OTHER, (0, 5)), Stage(ME, (5, 8))))
            await trio.sleep(0.1)
            assert a.stage is stage and a.status().epoch == 2  # same blocks: nothing reloads
            a.apply(announce(3, Stage(OTHER, (0, 8))))
            await reaches(a, "idle")
            assert a.stage is None and a.status().epoch == 3
            nursery.cancel_scope.cancel()


@pytest.mark.usefixtures("no_graph_cache")
async def test_a_range_that_grows_takes_the_loaded_blocks_over_and_reads_only_the_rest(tiny_model, read):
    model = served_model(str(tiny_model))
    a = Assignment(ME, model, "CPU", ComputeThread(), max_context=64, max_requests=1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            a.apply(announce(1, Stage(OTHER, (0, 5)), Stage(ME, (5, 8))))
            old = await a.wait_ready()
            assert blocks_in(read) == [5, 6, 7]
            read.clear()
            a.apply(announce(2, Stage(OTHER, (0, 3)), Stage(ME, (3, 8))))  # a stage between was lost
            grown = await loaded(a, (3, 8))
            assert (grown.start, grown.end) == (3, 8) and blocks_in(read) == [3, 4]
            assert all(grown.blk[i] is old.blk[i] for i in (5, 6, 7)) and grown.output is old.output
            assert "output_norm.weight" not in read
            read.clear()
            a.apply(announce(3, Stage(OTHER, (0, 6)), Stage(ME, (6, 8))))  # and back: nothing to read
            shrunk = await loaded(a, (6, 8))
            assert shrunk.blk[7] is old.blk[7] and blocks_in(read) == []
            nursery.cancel_scope.cancel()


@pytest.mark.usefixtures("no_graph_cache")
async def test_with_reuse_off_a_grown_range_is_read_whole(tiny_model, read):
    model = served_model(str(tiny_model))
    a = Assignment(ME, model, "CPU", ComputeThread(), max_context=64, max_requests=1, reuse_blocks=False)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            a.apply(announce(1, Stage(OTHER, (0, 5)), Stage(ME, (5, 8))))
            old = await a.wait_ready()
            read.clear()
            a.apply(announce(2, Stage(OTHER, (0, 3)), Stage(ME, (3, 8))))
            grown = await loaded(a, (3, 8))
            assert blocks_in(read) == [3, 4, 5, 6, 7]
            assert grown.blk[5] is not old.blk[5]
            nursery.cancel_scope.cancel()


@pytest.mark.usefixtures("no_graph_cache")
async def test_a_load_that_fails_is_reported_with_its_reason(tiny_model):
    model = served_model(str(tiny_model))
    a = Assignment(ME, model, "CPU", ComputeThread(), max_context=64, max_requests=1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            a.apply(announce(1, Stage(ME, (0, 12))))  # the model has 8 blocks
            await reaches(a, "failed")
            assert "bad block range [0, 12)" in a.status().error and a.stage is None
            nursery.cancel_scope.cancel()


@pytest.mark.slow  # the warmup captures the jitted graphs of the copy
async def test_a_spare_loads_and_warms_its_copy_and_takes_that_stage_over_without_loading(tiny_model):
    model = served_model(str(tiny_model))
    a = Assignment(ME, model, "CPU", ComputeThread(), max_context=64, max_requests=1)
    stages = (Stage(OTHER, (0, 5)), Stage(peer(3), (5, 8)))
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            spare = Plan(epoch=1, model=ModelRef("tiny"), stages=stages, standbys={ME: (5, 8)})
            a.apply(PlanAnnouncement(OTHER, 1, spare))
            await reaches(a, "standby")
            copy = a.stage
            assert a.status().layers == (5, 8) and copy._decode_jits  # warmed: the decode graphs are captured
            a.apply(announce(2, Stage(OTHER, (0, 5)), Stage(ME, (5, 8))))  # its stage's node was lost
            assert a.status().state == "ready" and a.status().epoch == 2  # at once, before run() wakes
            assert await a.wait_ready() is copy  # the same loaded stage: nothing reloaded
            nursery.cancel_scope.cancel()


@pytest.mark.slow  # captures every graph of the stage
async def test_with_warmup_a_stage_captures_every_decode_batch_size_before_it_is_ready(tiny_model):
    model = served_model(str(tiny_model))
    a = Assignment(ME, model, "CPU", ComputeThread(), max_context=64, max_requests=2, warmup=True)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            a.apply(announce(1, Stage(OTHER, (0, 5)), Stage(ME, (5, 8))))
            stage = await a.wait_ready()
            assert sorted({batch for batch, _, _ in stage._decode_jits}) == [1, 2]  # each batch size up to 2
            assert {scores for scores, _ in stage._prefill_jits} == {False, True}  # and prompt scoring
            assert len(stage.slots) == 0  # the throwaway requests are gone
            nursery.cancel_scope.cancel()


async def graphs_stored(a: Assignment, stage, count: int) -> None:
    """Wait until `count` graphs of `stage` are stored and the job that stored them has ended."""
    for _ in range(2400):
        if len(stage.graphs.stored) >= count:
            await a.compute.run(lambda: None)  # the one compute thread runs jobs in turn: the filling ended
            return
        await trio.sleep(0.05)
    raise AssertionError(f"the graph cache was not filled: {stage.graphs.stored}")


@pytest.mark.slow  # captures the stages' graphs
async def test_a_stage_fills_the_graph_cache_once_ready_and_the_next_load_of_it_is_warm_when_ready(
        tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMD_GRAPH_CACHE", str(tmp_path / "graphs"))
    model = served_model(str(tiny_model))
    first_graphs = ["prefill (blocks 5-7)", "decode, batch 1 (blocks 5-7)"]
    grown_graphs = ["prefill (blocks 3-7)", "decode, batch 1 (blocks 3-7)"]
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            cold = Assignment(ME, model, "CPU", ComputeThread(), max_context=64, max_requests=2)
            await nursery.start(cold.run)
            cold.apply(announce(1, Stage(OTHER, (0, 5)), Stage(ME, (5, 8))))
            stage = await cold.wait_ready()
            await graphs_stored(cold, stage, 2)  # in the background, after ready
            assert sorted(stage.graphs.stored) == sorted(first_graphs) and len(stage.slots) == 0
            cold.apply(announce(2, Stage(OTHER, (0, 3)), Stage(ME, (3, 8))))  # a re-plan grows the range
            await graphs_stored(cold, await loaded(cold, (3, 8)), 2)

            warm = Assignment(ME, model, "CPU", ComputeThread(), max_context=64, max_requests=2)
            await nursery.start(warm.run)
            warm.apply(announce(1, Stage(OTHER, (0, 5)), Stage(ME, (5, 8))))
            stage = await warm.wait_ready()
            assert sorted(stage.graphs.loaded) == sorted(first_graphs)  # loaded and run once before ready
            assert list(stage._decode_jits) == [(1, (5, 8, False), 0)]
            warm.apply(announce(2, Stage(OTHER, (0, 3)), Stage(ME, (3, 8))))
            grown = await loaded(warm, (3, 8))
            assert sorted(grown.graphs.loaded) == sorted(grown_graphs) and grown.graphs.stored == []
            assert grown.blk[5] is stage.blk[5]  # the blocks it held, taken over as before
            await trio.sleep(0.5)
            assert grown.graphs.stored == []  # nothing left to fill
            nursery.cancel_scope.cancel()
