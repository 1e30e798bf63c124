"""The process's one compute thread: every tinygrad call runs here, off the event loop and in order.

Heartbeats, probes and API calls never wait behind a prefill, and tinygrad, whose caches and
device state are not made for several threads at once, only ever sees one. `await
compute.run(fn, *args)` hands `fn` to the thread and waits for it; a caller that is cancelled stops
waiting, while the call itself runs to its end (a kernel cannot be interrupted). `compute.submit(fn, *args,
then=...)` returns at once and calls `then` on the event loop when `fn` has run.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class _Worker:
    """The thread itself: jobs run on it one at a time, in the order they were queued."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        use_a_kernel_cache_connection_per_thread()
        while True:
            self.jobs.get()()


THREAD_NAME = "swarmd-compute"
_worker: _Worker | None = None
_worker_lock = threading.Lock()


def _the_worker() -> _Worker:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = _Worker()
        return _worker


class ComputeThread:
    """A handle on the process's one compute thread. Every handle queues onto the same thread: tinygrad
    keeps per-process device state (on CPU, one task queue and one timeline signal), and two threads
    submitting at once can leave its worker waiting for a signal that never comes."""

    def __init__(self) -> None:
        self.busy_seconds = 0.0  # time spent running this handle's jobs, for metrics
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("this compute handle is closed")
        done = trio.Event()
        box: dict[str, Any] = {}

        def settle(value: Any, error: BaseException | None) -> None:
            box["value"], box["error"] = value, error
            done.set()

        self.submit(fn, *args, then=settle)
        await done.wait()
        if box["error"] is not None:
            raise box["error"]
        return box["value"]

    def submit(self, fn: Callable[..., T], *args: Any, then: Callable[[T | None, BaseException | None], None]) -> None:
        """Queue `fn(*args)` and return at once; `then(value, error)` runs on the calling trio thread when it
        has run (not at all if that trio run has ended); it must not raise. A caller that must act the moment a job ends (wake
        the tasks waiting for it) does so in `then`, one scheduler pass sooner than a task awaiting `run`."""
        if self._closed:
            raise RuntimeError("this compute handle is closed")
        token = trio.lowlevel.current_trio_token()

        def job() -> None:
            t0 = time.perf_counter()
            value: Any = None
            error: BaseException | None = None
            try:
                value = fn(*args)
            except BaseException as e:
                error = e
            self.busy_seconds += time.perf_counter() - t0
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(then, value, error)

        _the_worker().jobs.put(job)

    def close(self) -> None:
        """Refuse further jobs from this handle (those queued so far still run)."""
        self._closed = True


def wait_until_idle(timeout: float) -> bool:
    """Block until every job queued so far has run (False if that takes longer than `timeout` s): a
    caller about to use tinygrad on its own thread must not overlap a job still running here."""
    if _worker is None:
        return True
    finished = threading.Event()
    _worker.jobs.put(finished.set)
    return finished.wait(timeout)


def use_a_kernel_cache_connection_per_thread() -> None:
    """tinygrad keeps one SQLite connection per process for its compiled-kernel cache, and Python's
    sqlite3 refuses a connection in any thread but the one that opened it: so once tinygrad has run
    on one thread (a test, `swarmd run` in-process), it fails on every other. Give each thread its own
    connection to the same cache file (SQLite's usual way to share a database between threads)."""
    import tinygrad.helpers as helpers

    if getattr(helpers.db_connection, "per_thread", False):
        return
    local = threading.local()

    def db_connection() -> sqlite3.Connection:
        conn = getattr(local, "conn", None)
        if conn is None:
            os.makedirs(os.path.dirname(helpers.CACHEDB), exist_ok=True)
            conn = sqlite3.connect(helpers.CACHEDB, timeout=60, isolation_level="IMMEDIATE")
            with contextlib.suppress(sqlite3.OperationalError):
                conn.execute("PRAGMA journal_mode=WAL").fetchone()
            local.conn = conn
        return conn

    db_connection.per_thread = True  # type: ignore[attr-defined]
    helpers.db_connection = db_connection
