"""One MoE layer's expert call made from a lane's reader thread (a hot step): its answer, gathered from anywhere.

`MoERouter.fan_out` sends one `ExpertBatch` per remote node at once (on the hot lane), then the stage's thread
computes the experts this daemon holds while those are in flight. Each part's answer (one output per selected
pair of its rows) is put in its place in one buffer made for the call, and `out` makes each row's gate-weighted
sum in the order of its selections (`models.moe.gated_sum`), as the router's `call` does, so the sum
does not depend on which node answered which expert or in what order. The last part in completes
the call, whichever thread brings it: a lane's reader (an `ExpertResult` on the lane), the event loop (one the
transport carried, or the router's own asking again of a part whose node failed), or the stage's thread itself
when the answers were in before it finished its own part. `then(fan_out)` is called once, by that thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class FanOut:
    call: Any  # the layer's models.moe.ExpertCall
    per: np.ndarray  # (rows, k, dim) float32: each selection's expert output, as the parts come in
    left: int  # parts not in yet
    lock: threading.Lock = field(default_factory=threading.Lock)
    error: Exception | None = None  # the call cannot be answered: the step fails with it
    then: Callable[[FanOut], None] | None = None
    done: bool = False
    started: float = 0.0  # perf_counter when the batches left
    messages: int = 0  # batches sent to other nodes
    nodes: int = 0  # nodes asked, this one included
    asked: list[str] = field(default_factory=list)  # the batch ids of its parts sent as `ExpertBatch`es

    @classmethod
    def of(cls, call: Any, parts: int) -> FanOut:
        n, k = call.sel.shape
        return cls(call, np.zeros((n, k, call.rows.shape[1]), np.float32), parts)

    def add(self, answers: Iterable[tuple[Any, np.ndarray]]) -> None:
        """One part's answer (any thread): (a `dispatch.NodePart` of the call, its experts' outputs, one per
        selected pair in row-major order) for each node that answered it."""
        with self.lock:
            if self.done or self.error is not None:
                return
            for part, answer in answers:
                mine = np.zeros(self.call.sel.shape, bool)
                mine[part.rows] = part.call.sel >= 0
                self.per[mine] = answer
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
    def out(self) -> np.ndarray:
        """(rows, dim): each row's gate-weighted sum of its selections' outputs, in the order of its selections."""
        from models.moe import gated_sum

        return gated_sum(self.call, self.per[self.call.sel >= 0])

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
