"""The daemon's one compute thread: every tinygrad call runs here, off the event loop and in order.

Heartbeats, probes and API calls never wait behind a prefill, and tinygrad, whose caches and
device state are not made for several threads at once, only ever sees one. `await
compute.run(fn, *args)` hands `fn` to the thread and waits for it; a caller that is cancelled stops
waiting, while the call itself runs to its end (a kernel cannot be interrupted).
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


class ComputeThread:
    def __init__(self, name: str = "swarmd-compute") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.busy_seconds = 0.0  # time spent running jobs, for metrics

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if not self._thread.is_alive():
            self._thread.start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: dict[str, Any] = {}

        def job() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as e:
                box["error"] = e
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        self._jobs.put(job)
        await done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        """Let the thread end after the jobs queued so far."""
        self._jobs.put(None)

    def _main(self) -> None:
        use_a_kernel_cache_connection_per_thread()
        while (job := self._jobs.get()) is not None:
            t0 = time.perf_counter()
            job()
            self.busy_seconds += time.perf_counter() - t0


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
