"""A stage's expert calls answered by this daemon's own expert shard, where the forward runs.

A MoE stage's forward stops after each MoE block with an `ExpertCall`, which the router splits by node,
sending one batch to each holder: this daemon's own experts too, handed over in-process to its expert
actor. When this daemon's shard holds every expert a call selects, that trip (compute thread -> event loop
-> router -> expert actor -> compute thread -> event loop -> compute thread) costs more than the experts: on
an H200, 1.3 ms per MoE block against 0.4 ms of compute. `answer` computes such a call on the compute
thread, inside the stage's step, and keeps a record that the router counts on the event loop
(`MoERouter.record_local`) as a call that hit one node and sent no message. A call that needs another node,
or that the shard fails, goes to the router as before (which reports the failure).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LocalAnswer:
    call: Any  # the models.moe.ExpertCall answered
    start: float  # on the clock the router's spans use
    end: float


Record = Callable[[LocalAnswer, Mapping[str, int]], None]


class LocalExperts:
    """This daemon's expert shard (`shard()`: the loaded one, or None) as a stage's first choice for a call.
    A stage has one batch on the compute thread at a time, and hands the records of its answers to `record`
    (`count`, on the event loop) between its batch's segments."""

    def __init__(self, shard: Callable[[], Any], record: Record, clock: Callable[[], float]) -> None:
        self._shard = shard
        self._record = record
        self.clock = clock
        self._answered: list[LocalAnswer] = []

    def answer(self, call: Any) -> np.ndarray | None:
        """On the compute thread: the gate-weighted expert sum for every row of `call` if the shard holds every
        expert it selects, else None."""
        shard = self._shard()
        if shard is None or not holds_every_selected(shard.holds(call.layer), call.sel):
            return None
        start = self.clock()
        try:
            out = shard(call)
        except Exception:  # the router asks again and reports what went wrong
            return None
        self._answered.append(LocalAnswer(call, start, self.clock()))
        return out

    def part(self, call: Any) -> np.ndarray | None:
        """On the thread that holds tinygrad: the expert outputs (one per selected pair, row-major) for the part of
        a layer's call that the router gave this daemon (a hot step's fan-out; counted by the router), or None if
        the shard cannot."""
        shard = self._shard()
        if shard is None or not holds_every_selected(shard.holds(call.layer), call.sel):
            return None
        try:
            return shard.expert_outputs(call)
        except Exception:  # the router asks again and reports what went wrong
            return None

    @property
    def answered(self) -> bool:
        """Whether calls answered here wait to be counted."""
        return bool(self._answered)

    def count(self, traced: Mapping[str, int]) -> None:
        """On the event loop, once the compute thread is done with a segment: record the calls it answered
        (`traced`: the traced requests among the batch's rows and their steps)."""
        answered, self._answered = self._answered, []
        for a in answered:
            self._record(a, traced)


def holds_every_selected(held: tuple[int, ...], sel: np.ndarray) -> bool:
    """Whether the experts `held` include every expert `sel` selects (-1: no expert)."""
    chosen = sel[sel >= 0]
    return bool(held) and bool(np.isin(chosen, held).all())
