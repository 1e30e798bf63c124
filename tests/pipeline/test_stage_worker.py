"""How a stage's worker and the compute thread's completions share the work of a batch (no model needed)."""

from __future__ import annotations

import numpy as np

from swarmd.compute import ComputeThread
from swarmd.stage import Batch, Job, StageActor
from swarmd.stage_session import Work


def idle_stage() -> StageActor:
    stage = StageActor(lambda: None, compute=ComputeThread(), max_context=64, wire_dtype=None, idle_timeout=60)
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
