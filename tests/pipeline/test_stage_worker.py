"""How a stage's worker and the compute thread's completions share the work of a batch, and which thread runs a
step (no real model needed)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import trio

from swarmd.inference.compute import ComputeThread
from swarmd.inference.registry import Registry
from swarmd.inference.stage.actor import StageActor
from swarmd.inference.stage.book import Work
from swarmd.inference.stage.job import Batch, Job, Loaded
from swarmd.wire import Forward, Sampling, WireTensor


async def nothing_to_post(sends) -> None:
    raise AssertionError("these tests run batches, not handlers: no output is posted")


def idle_stage() -> StageActor:
    stage = StageActor(lambda: None, compute=ComputeThread(), max_context=64, wire_dtype=None, idle_timeout=60,
                       post_all=nothing_to_post)
    stage._idle = True  # as its worker is while it waits for work
    return stage


def launched(stage: StageActor, *request_ids: str) -> Batch:
    """A batch a handler started on the compute thread while the worker slept."""
    jobs = [Job(Work(rid, 1, 4, np.zeros((1, 8), np.float32)), model=None) for rid in request_ids]
    batch = stage._inflight = Batch(jobs, steps=iter(()))
    return batch


async def test_a_batch_done_in_one_segment_is_finished_without_waking_the_worker():
    stage = idle_stage()
    batch = launched(stage, "a", "b")
    stage._segment_done(batch, (True, None), None)
    assert all(job.done.is_set() for job in batch.jobs)  # the handlers go on
    assert stage._inflight is None and stage.stats.batches == 1 and stage.stats.jobs == 2
    assert not stage._wake.is_set()


async def test_the_worker_is_woken_when_work_queued_meanwhile_or_the_batch_needs_it():
    stage = idle_stage()
    batch = launched(stage, "a")
    stage._jobs.append(Job(Work("b", 1, 4, np.zeros((1, 8), np.float32)), model=None))
    stage._segment_done(batch, (True, None), None)
    assert stage._inflight is None and stage._wake.is_set()  # it takes the queued job next

    for answer, error in (((False, "experts of block 3"), None), (None, RuntimeError("the model failed"))):
        stage = idle_stage()
        batch = launched(stage, "a")
        stage._segment_done(batch, answer, error)
        assert stage._inflight is batch and stage._wake.is_set()  # it asks the experts, or reports the error
        assert not batch.jobs[0].done.is_set() and batch.arrived.is_set()


class RecordingModel:
    """Stands in for a StageModel: passes hidden states through and says on which thread it ran."""

    is_last, hidden_size, start, end = False, 8, 0, 4

    def __init__(self) -> None:
        self.threads: list[str] = []

    def forward_steps(self, inputs):
        self.threads.append(threading.current_thread().name)
        return [np.asarray(i.data, np.float32) for i in inputs]
        yield  # a generator, as a MoE stage's is


def queued(stage: StageActor, model: RecordingModel, rows: int, *request_ids: str,
           others: tuple[str, ...] = ()) -> list[Job]:
    """Jobs of `request_ids` queued on the stage, which also holds requests `others` (elsewhere in the chain)."""
    stage._model = model  # the stage's current model
    stage.book = SimpleNamespace(requests=dict.fromkeys((*request_ids, *others)))  # the requests it holds
    jobs = [Job(Work(rid, 1, 4, np.zeros((rows, 8), np.float32)), model=model, book=stage.book)
            for rid in request_ids]
    stage._jobs += jobs
    return jobs


async def wait_done(jobs: list[Job]) -> None:
    with trio.fail_after(10):
        for job in jobs:
            await job.done.wait()


async def test_a_decode_step_of_a_size_seen_to_be_short_runs_on_the_event_loops_thread():
    stage, model = idle_stage(), RecordingModel()
    stage.inline_step_s = 0.05
    loop = threading.current_thread().name
    first = queued(stage, model, 1, "a")
    stage._launch()  # never seen: its first run may capture a graph, so it goes to the compute thread
    await wait_done(first)
    for _ in range(20):  # the compute thread may still be collecting garbage after its job: the step waits
        again = queued(stage, model, 1, "a")
        stage._launch()
        if again[0].done.is_set():  # done before _launch returned
            break
        await wait_done(again)
    assert again[0].done.is_set() and stage._inflight is None and model.threads[-1] == loop
    assert np.array_equal(again[0].output, np.zeros((1, 8), np.float32))
    pair = queued(stage, model, 1, "a", "b")
    stage._launch()  # a batch of two was never seen
    await wait_done(pair)
    assert model.threads[0] == model.threads[-1] == "swarmd-compute"


async def test_prefills_slow_steps_partial_batches_and_a_stage_with_inlining_off_use_the_compute_thread():
    cases = ((0.05, 3, 0.001, ()), (0.05, 1, 0.2, ()), (0.0, 1, 0.001, ()), (0.05, 1, 0.001, ("b",)))
    for inline_step_s, rows, took, others in cases:
        stage, model = idle_stage(), RecordingModel()
        stage.inline_step_s = inline_step_s
        jobs = queued(stage, model, rows, "a", others=others)
        stage._decode_s[1] = took
        stage._launch()
        await wait_done(jobs)
        assert model.threads == ["swarmd-compute"], (inline_step_s, rows, took, others)


class SlotModel(RecordingModel):
    """A RecordingModel with KV slots."""

    max_requests, max_context, vocab_size = 4, 64, 100

    def __init__(self) -> None:
        super().__init__()
        self.slots: set[str] = set()

    def add_request(self, request_id: str) -> None:
        self.slots.add(request_id)

    def free_request(self, request_id: str) -> None:
        self.slots.discard(request_id)


async def test_a_step_queued_for_a_request_its_stage_dropped_reserves_no_kv_slot():
    old, new = SlotModel(), SlotModel()
    registry = Registry(1, ("S0", "S1"), ((0, 4), (4, 8)), {})
    loaded = [Loaded(old, 1, registry)]
    stage = StageActor(lambda: loaded[0], compute=ComputeThread(), max_context=64, wire_dtype=None,
                       idle_timeout=60, post_all=nothing_to_post)
    _, book = stage._book()
    prompt = Forward("r", 0, 1, 0, "H", hidden=WireTensor.from_array(np.ones((3, 8), np.float32)),
                     sampling=Sampling(max_tokens=4), epoch=1)
    job = Job(book.on_forward(prompt, now=0.0), old, loaded[0], book)
    stage._jobs.append(job)  # its prefill waits for the batch ahead of it (a MoE step waiting for its experts)
    loaded[0] = Loaded(new, 1, registry)  # a new plan: the stage's model is replaced before the prefill runs
    stage._book()  # the old book's requests are gone, their KV caches to be freed
    stage._launch()
    await wait_done([job])
    assert old.slots == set() and old.threads == []  # freed with the old book: the step must not take a slot again
    assert stage._outputs(job) is None  # and it sends nothing: the request is lost here
    stage.compute.close()


async def test_a_busy_compute_thread_is_never_joined_by_a_step_on_the_event_loop():
    compute = ComputeThread()
    release = threading.Event()
    started = threading.Event()

    def long_job() -> None:
        started.set()
        release.wait(10)

    compute.submit(long_job, then=lambda value, error: None)
    started.wait(10)
    assert compute.run_inline(lambda: "ran") == (False, None, None)  # the caller submits instead
    release.set()
    await compute.run(lambda: None)
    for _ in range(500):  # idle once it is done (it may collect garbage first, holding tinygrad meanwhile)
        ran = compute.run_inline(threading.current_thread)
        if ran[0]:
            break
        await trio.sleep(0.01)
    assert ran == (True, threading.current_thread(), None)
    compute.close()
