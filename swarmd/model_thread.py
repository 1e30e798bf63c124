"""Every tinygrad call of a daemon runs on one OS thread.

tinygrad is not thread-safe: its kernel cache is one sqlite connection that may only be used by the thread
that opened it, and its scheduler and JIT keep global state. trio's worker threads come and go, so the device
benchmark, stage loading and stage compute all go through `run_model`, which queues the call on this
process's one model thread and waits for it without holding a trio worker thread:

    stage = await run_model(load_stage, model, 0, 10, ..., abandon_on_cancel=True)
    outputs = await run_model(stage.forward, items)

Calls run one at a time in the order they were queued. The thread is a daemon thread, so a stopping daemon
does not wait for a long load it abandoned. The thread opens tinygrad's kernel cache for any thread (it is
still used by one at a time), so a process where other code already touched tinygrad (a test session) works.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class ModelThread:
    def __init__(self, name: str = "swarmd-model") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
        future: Future[T] = Future()
        self._jobs.put((fn, args, future))
        return future

    def _loop(self) -> None:
        share_kernel_cache()
        while True:
            fn, args, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter, which re-raises it
                future.set_exception(e)

    async def run(self, fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False) -> T:
        """`fn(*args)` on the model thread. Not cancellable unless `abandon_on_cancel` (then it runs on alone)."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_: Future[Any]) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        future = self.submit(fn, *args)
        future.add_done_callback(wake)
        if abandon_on_cancel:
            await done.wait()
        else:
            with trio.CancelScope(shield=True):
                await done.wait()
        return future.result()


_shared = threading.Lock()
_shared_done = False


def share_kernel_cache() -> None:
    """Replace tinygrad's kernel-cache connection (sqlite, bound to the thread that opened it) with one any
    thread may use, once per process. Calls stay serialised: through the model thread, or a test's own."""
    global _shared_done
    import contextlib
    import os
    import sqlite3

    from tinygrad import helpers

    with _shared:
        if _shared_done:
            return
        os.makedirs(os.path.dirname(helpers.CACHEDB), exist_ok=True)
        connection = sqlite3.connect(helpers.CACHEDB, timeout=60, isolation_level="IMMEDIATE", check_same_thread=False)
        with contextlib.suppress(sqlite3.OperationalError):
            connection.execute("PRAGMA journal_mode=WAL").fetchone()
        helpers._db_connection = connection  # type: ignore[assignment]
        _shared_done = True


MODEL_THREAD = ModelThread()


def call_model(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the model thread, from synchronous code (scripts, test fixtures); blocks until done."""
    return MODEL_THREAD.submit(fn, *args).result()


async def run_model(fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False) -> T:
    return await MODEL_THREAD.run(fn, *args, abandon_on_cancel=abandon_on_cancel)
