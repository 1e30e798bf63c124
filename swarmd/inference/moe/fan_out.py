"""One MoE layer's expert call made from a lane's reader thread (a hot step): its answer, gathered from anywhere.

`MoERouter.fan_out` sends one `ExpertBatch` per remote node at once (on the hot lane), then the stage's thread
computes the experts this daemon holds while those are in flight. Each answer is added into one buffer made
for the call (the batches' answers are read straight from their frames into it). The last part in completes
the call, whichever thread brings it: a lane's reader (an `ExpertResult` on the lane), the event loop (one the
transport carried, or the router's own asking again of a part whose node failed), or the stage's thread itself
when the answers were in before it finished its own part. `then(fan_out)` is called once, by that thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class FanOut:
    call: Any  # the layer's models.moe.ExpertCall
    out: np.ndarray  # (rows, dim) float32: the answers summed so far
    left: int  # parts not in yet
    lock: threading.Lock = field(default_factory=threading.Lock)
    error: Exception | None = None  # the call cannot be answered: the step fails with it
    then: Callable[[FanOut], None] | None = None
    done: bool = False
    started: float = 0.0  # perf_counter when the batches left
    messages: int = 0  # batches sent to other nodes
    nodes: int = 0  # nodes asked, this one included

    @classmethod
    def of(cls, call: Any, parts: int) -> FanOut:
        return cls(call, np.zeros(call.rows.shape, np.float32), parts)

    def add(self, rows: np.ndarray, answer: np.ndarray) -> None:
        """A part's answer for `rows` of the call (any thread)."""
        with self.lock:
            if self.done or self.error is not None:
                return
            self.out[rows] += answer
            self.left -= 1
            fire = self._due()
        if fire:
            self._fire()

    def fail(self, error: Exception) -> None:
        """No holder answers a part: the step fails with `error` (any thread)."""
        with self.lock:
            if self.done or self.error is not None:
                return
            self.error, self.left = error, 0
            fire = self._due()
        if fire:
            self._fire()

    def wait_then(self, then: Callable[[FanOut], None]) -> bool:
        """`then(self)` once the last part is in; False if every part is in already (the caller goes on)."""
        with self.lock:
            if self.left == 0:
                self.done = True
                return False
            self.then = then
        return True

    @property
    def complete(self) -> bool:
        with self.lock:
            return self.left == 0

    def _due(self) -> bool:
        """With `lock` held: the last part is in and someone waits for it."""
        if self.left > 0 or self.then is None or self.done:
            return False
        self.done = True
        return True

    def _fire(self) -> None:
        assert self.then is not None
        self.then(self)
