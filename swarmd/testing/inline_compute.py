"""The compute thread's in-process twin: every job runs at once on the event loop's own thread.

In a simulation on trio's virtual clock nothing may run beside the event loop: a job on another thread
would let the clock jump while it runs, and a seed would not replay. Here a job runs to its end inside the
call, so virtual time stands still during a model step, exactly as if the step took no time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class InlineCompute:
    """`swarmd.inference.compute.Compute`, running each job inline."""

    def __init__(self) -> None:
        self.busy_seconds = 0.0
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        value, error = self._call(fn, args)
        await trio.lowlevel.checkpoint()
        if error is not None:
            raise error
        return value  # type: ignore[return-value]

    def submit(self, fn: Callable[..., T], *args: Any,
               then: Callable[[T | None, BaseException | None], None]) -> None:
        value, error = self._call(fn, args)
        trio.lowlevel.current_trio_token().run_sync_soon(then, value, error)

    def run_inline(self, fn: Callable[..., T], *args: Any) -> tuple[bool, T | None, BaseException | None]:
        value, error = self._call(fn, args)
        return True, value, error

    def hold(self, wait: float = 0.0) -> bool:
        return not self._closed

    def release(self) -> None:
        return None

    def close(self) -> None:
        self._closed = True

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, BaseException | None]:
        if self._closed:
            raise RuntimeError("this compute handle is closed")
        t0 = time.perf_counter()
        try:
            return fn(*args), None
        except BaseException as e:
            return None, e
        finally:
            self.busy_seconds += time.perf_counter() - t0
