"""All tinygrad work of a daemon runs on one thread, in the order it was asked for."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import trio

from swarmd.model_thread import ModelThread, call_model


def test_calls_run_one_at_a_time_on_one_thread_in_order():
    worker = ModelThread("test-model")
    seen: list[tuple[int, str]] = []

    def job(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    futures = [worker.submit(job, i) for i in range(5)]
    assert [f.result(timeout=5) for f in futures] == [0, 1, 4, 9, 16]
    assert seen == [(i, "test-model") for i in range(5)]


async def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    worker = ModelThread()

    def boom() -> None:
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        await worker.run(boom)
    assert await worker.run(lambda: 7) == 7


async def test_a_cancelled_caller_waits_for_the_call_unless_it_abandons_it():
    worker = ModelThread()
    release = threading.Event()

    def slow(value: str) -> str:
        release.wait(5)
        return value

    with trio.move_on_after(0.05) as abandoned:
        await worker.run(slow, "abandoned", abandon_on_cancel=True)
    assert abandoned.cancelled_caught  # the caller left; the call still holds the thread
    threading.Timer(0.2, release.set).start()  # the abandoned call ends then; the next one waits behind it
    started = trio.current_time()
    with trio.move_on_after(0.05):
        result = await worker.run(slow, "kept")  # a deadline does not interrupt a model call
    assert result == "kept" and trio.current_time() - started >= 0.15


def test_synchronous_code_can_call_the_model_thread():
    assert call_model(threading.current_thread) is not threading.current_thread()


def test_the_model_thread_works_after_another_thread_opened_tinygrads_kernel_cache(tmp_path):
    script = """
from tinygrad import Tensor
from tinygrad.helpers import db_connection
from swarmd.model_thread import call_model
db_connection()  # opened by the main thread, as a test fixture or a device benchmark would
print(call_model(lambda: (Tensor([1.0, 2.0, 3.0]) * 2).sum().item()))
"""
    env = {**os.environ, "CACHEDB": str(tmp_path / "cache.db")}  # a cold cache: the kernel is compiled and stored
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "12.0"
