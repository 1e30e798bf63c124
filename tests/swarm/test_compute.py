"""The compute thread: one thread for all tinygrad work, off the event loop."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import trio

from swarmd.inference.compute import ComputeThread

pytestmark = pytest.mark.usefixtures("tinygrad_in_process")


async def test_jobs_run_in_order_on_one_other_thread_and_errors_come_back():
    compute = ComputeThread()
    names = [await compute.run(lambda: threading.current_thread().name) for _ in range(3)]
    assert set(names) == {"swarmd-compute"} and threading.current_thread().name != "swarmd-compute"
    with pytest.raises(ZeroDivisionError):
        await compute.run(lambda: 1 / 0)
    assert await compute.run(sum, [1, 2, 3]) == 6
    compute.close()


async def test_the_event_loop_keeps_ticking_during_a_long_job():
    compute = ComputeThread()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await compute.run(time.sleep, 0.5)
        nursery.cancel_scope.cancel()
    assert ticks >= 20
    compute.close()


async def test_tinygrad_runs_there_after_it_ran_on_the_main_thread():
    from tinygrad import Tensor

    assert (Tensor([1.0, 2.0]) * 3).tolist() == [3.0, 6.0]  # opens tinygrad's kernel cache here
    compute = ComputeThread()
    assert await compute.run(lambda: (Tensor([1.0, 2.0]) + 5).tolist()) == [6.0, 7.0]
    compute.close()


async def test_submit_returns_at_once_and_its_callback_runs_on_the_event_loop_with_the_result_or_error():
    compute = ComputeThread()
    loop_thread = threading.current_thread().name
    seen: list[tuple[object, str, str]] = []
    both = trio.Event()

    def then(value, error):
        seen.append((value, type(error).__name__, threading.current_thread().name))
        if len(seen) == 2:
            both.set()

    compute.submit(lambda: 41 + 1, then=then)
    compute.submit(lambda: 1 / 0, then=then)
    assert seen == []  # nothing ran on the caller's side yet
    with trio.fail_after(10):
        await both.wait()
    assert seen == [(42, "NoneType", loop_thread), (None, "ZeroDivisionError", loop_thread)]
    compute.close()
    with pytest.raises(RuntimeError):
        compute.submit(sum, [1], then=then)


def test_a_daemon_collects_cyclic_garbage_on_the_compute_thread_only_and_counts_the_collections():
    # In a fresh process: collection is process-wide state. Garbage made on the main thread (as the event
    # loop makes it) is finalised on the compute thread, whether it is busy or idle, never where it was made.
    # The collections it ran are counted and timed for /metrics.
    script = """
import gc, threading, time
from swarmd.inference.compute import collect_garbage_on_the_compute_thread
from swarmd.observe.gc_collections import COLLECTIONS
collect_garbage_on_the_compute_thread()
assert not gc.isenabled()
where = []
class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        where.append(threading.current_thread().name)
for _ in range(3 * gc.get_threshold()[0]):
    Cycle()
deadline = time.monotonic() + 10
while len(where) < 3 * gc.get_threshold()[0] and time.monotonic() < deadline:
    time.sleep(0.05)
print(sorted(set(where)), len(where), COLLECTIONS.count[0] >= 1, COLLECTIONS.seconds[0] > 0)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split("]")[0] == "['swarmd-compute'" and out.split()[-2:] == ["True", "True"], out

