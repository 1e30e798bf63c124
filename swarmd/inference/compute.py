"""The process's one compute thread: every tinygrad call runs here, off the event loop and in order.

Heartbeats, probes and API calls never wait behind a prefill, and tinygrad, whose caches and
device state are not made for several threads at once, only ever sees one. `await
compute.run(fn, *args)` hands `fn` to the thread and waits for it; a caller that is cancelled stops
waiting, while the call itself runs to its end (a kernel cannot be interrupted). `compute.submit(fn, *args,
then=...)` returns at once and calls `then` on the event loop when `fn` has run.

Python's cyclic garbage collector runs on whichever thread happens to allocate when a threshold is crossed,
tinygrad's own CPU worker thread included. A dropped stage's jitted graphs are cyclic garbage, and a graph's
finaliser frees its buffers by waiting for the device to finish: on that worker thread it waits for itself,
and the daemon hangs (seen when a plan replaced a stage). So a daemon hands collection to the compute thread
(`collect_garbage_on_the_compute_thread`), which collects between jobs as the automatic collector would.

Each collection holds the interpreter lock, so a step's output waits for it: `swarmd.observe.gc_collections.COLLECTIONS`
counts them and their time (in /metrics).

A short call (a decode step of a few milliseconds) may instead run on the event loop's own thread, when the
compute thread has nothing to do (`ComputeThread.run_inline`): handing a job to another thread and back costs
two wake-ups and two waits for the interpreter lock, about 0.4 ms on a 2-core CPU, where a token crosses
each stage once. A lane's reader thread (`swarmd.transport.lane`) may run one too, between `hold()` and
`release()`. `tinygrad_lock` keeps tinygrad on one thread at a time either way.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import trio

from swarmd.observe.gc_collections import COLLECTIONS

T = TypeVar("T")


class Compute(Protocol):
    """Where a daemon's tinygrad calls run: `ComputeThread`, or its in-process twin in `swarmd.testing`."""

    busy_seconds: float

    async def run(self, fn: Callable[..., T], *args: Any) -> T: ...

    def submit(self, fn: Callable[..., T], *args: Any,
               then: Callable[[T | None, BaseException | None], None]) -> None: ...

    def run_inline(self, fn: Callable[..., T], *args: Any) -> tuple[bool, T | None, BaseException | None]: ...

    def hold(self, wait: float = 0.0) -> bool: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class _Worker:
    """The thread itself: jobs run on it one at a time, in the order they were queued."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.tinygrad_lock = threading.Lock()  # held by whichever thread runs tinygrad (or collects) now
        self.collects_garbage = False  # the cyclic collector runs here, between jobs (and when idle)
        self.thread = threading.Thread(target=self._main, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk

        use_a_kernel_cache_connection_per_thread()
        keep_compiled_programs_on_disk()
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_COLLECT_S)
            except queue.Empty:
                job = None
            if job is not None:
                with self.tinygrad_lock:
                    job()
            if self.collects_garbage:
                with self.tinygrad_lock:
                    collect_if_due()


THREAD_NAME = "swarmd-compute"
IDLE_COLLECT_S = 1.0  # an idle compute thread still collects what the event loop's thread left
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
            value, error = self._call(fn, args)
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(then, value, error)

        _the_worker().jobs.put(job)

    def run_inline(self, fn: Callable[..., T], *args: Any) -> tuple[bool, T | None, BaseException | None]:
        """Run `fn(*args)` here, on the calling thread, if the compute thread is idle and nothing is queued:
        (True, value, error). When it is busy, (False, None, None) at once, and the caller submits instead.
        Blocks the event loop for as long as `fn` runs: for calls measured to be short."""
        if self._closed:
            raise RuntimeError("this compute handle is closed")
        worker = _the_worker()
        if not worker.jobs.empty() or not worker.tinygrad_lock.acquire(blocking=False):
            return False, None, None
        try:
            value, error = self._call(fn, args)
        finally:
            worker.tinygrad_lock.release()
        return True, value, error

    def hold(self, wait: float = 0.0) -> bool:
        """Take tinygrad for the calling thread (a lane's reader running a short step) if the compute thread is
        idle and nothing is queued, waiting at most `wait` s for it; False otherwise. `release()` when done."""
        if self._closed:
            return False
        worker = _the_worker()
        if not worker.jobs.empty():
            return False
        return worker.tinygrad_lock.acquire(blocking=wait > 0, timeout=wait if wait > 0 else -1)

    def release(self) -> None:
        _the_worker().tinygrad_lock.release()

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, BaseException | None]:
        """`fn(*args)` timed into `busy_seconds`: (value, None), or (None, the error it raised)."""
        t0 = time.perf_counter()
        value: Any = None
        error: BaseException | None = None
        try:
            value = fn(*args)
        except BaseException as e:
            error = e
        self.busy_seconds += time.perf_counter() - t0
        return value, error

    def close(self) -> None:
        """Refuse further jobs from this handle (those queued so far still run)."""
        self._closed = True


def _run_on_the_worker(fn: Callable[[], object], timeout: float) -> bool:
    """Queue `fn` behind every job so far and block until it has run (False after `timeout` s)."""
    assert _worker is not None
    finished = threading.Event()

    def job() -> None:
        fn()
        finished.set()

    _worker.jobs.put(job)
    return finished.wait(timeout)


def wait_until_idle(timeout: float) -> bool:
    """Block until every job queued so far has run (False if that takes longer than `timeout` s): a
    caller about to use tinygrad on its own thread must not overlap a job still running here."""
    return _worker is None or _run_on_the_worker(lambda: None, timeout)


def collect_garbage_on_the_compute_thread() -> None:
    """Turn Python's automatic cyclic collection off and let the compute thread collect instead, so that no
    finaliser of a tinygrad object runs on tinygrad's worker thread. For a process whose tinygrad calls all
    go through `ComputeThread` (a daemon)."""
    gc.disable()
    _the_worker().collects_garbage = True


def _collect(generation: int) -> None:
    t0 = time.perf_counter()
    gc.collect(generation)
    COLLECTIONS.record(generation, time.perf_counter() - t0)


def collect_if_due() -> None:
    """What the automatic collector would do now: collect the oldest generation past its threshold."""
    counts, limits = gc.get_count(), gc.get_threshold()
    if counts[0] < limits[0]:
        return
    generation = 0
    if counts[1] >= limits[1]:
        generation = 2 if counts[2] >= limits[2] else 1
    _collect(generation)


def collect_due_garbage(timeout: float) -> bool:
    """`collect_if_due` on the compute thread (on this thread if it never started); False if that took
    longer than `timeout` s. For a caller that runs tinygrad on its own thread only while the compute thread
    is idle (a test), with automatic collection off."""
    if _worker is None:
        collect_if_due()
        return True
    return _run_on_the_worker(collect_if_due, timeout)


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
