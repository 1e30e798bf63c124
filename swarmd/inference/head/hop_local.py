"""Hop-local KV rebuild: when a moved request's new chain keeps some stages, only the others recompute. Pure.

A request moves (`swarmd.inference.head.recovery`) as a new attempt that replays its whole token history from position 0.
When the new chain has the same stages, block range for block range, and only some of them are held by other
peers (a standby took a dead stage's place), the stages that stayed still hold the old attempt's KV cache.
The head then names the old attempt in the replay's first Forward (`resume_of`), and each stage decides for
itself, from what it holds:

* a stage that holds the old attempt (idle, its cache and, but on the last stage, the rows it sent on) adopts
  it under the new id, truncated to the positions the history covers (and to one fewer, so that it computes
  at least the last position, whose output the next stage or the sampler needs);
* a stage that does not (the new one) computes every position, from the previous stage's rows.

Every stage but the last keeps the rows it sent on (`SentRows`), so that on a move it can send the next stage
all rows [0, T) again, the kept prefix and what it just computed; the next stage takes the suffix it lacks.
A stage that cannot adopt computes everything: the full replay is the same messages with nothing kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from swarmd.inference.registry import Registry


@dataclass(frozen=True)
class MovePlan:
    """How the head moves a request from chain `old` to chain `new`: the hops whose peer keeps the old attempt
    (the head names it in the replay and does not cancel it there) and the (hop, peer) pairs to cancel it on."""

    kept: tuple[tuple[int, str], ...]
    cancel: tuple[tuple[int, str], ...]

    @property
    def hop_local(self) -> bool:
        return bool(self.kept)


def plan_move(old: Registry, new: Registry, *, allowed: bool = True) -> MovePlan:
    """Keep the old attempt on the peers that hold the same hop with the same blocks in `new`, when every hop's
    blocks are unchanged; otherwise (or when not `allowed`) a full replay: cancel it on every old stage."""
    everywhere = tuple(enumerate(old.stages))
    if not allowed or not old.stages or old.layers != new.layers:
        return MovePlan((), everywhere)
    kept = tuple((hop, peer) for hop, peer in everywhere if new.stages[hop] == peer)
    return MovePlan(kept, tuple(hp for hp in everywhere if hp not in kept))


def keep_positions(held: int, sent_rows: int | None, total: int) -> int:
    """How many of its `held` KV positions a stage keeps when a replay of `total` positions arrives: at most
    `total - 1` (it computes the last position again) and, on a stage that sends rows on (`sent_rows` is not
    None), no more than the rows it kept. 0: it adopts nothing and computes every position."""
    keep = min(held, total - 1)
    if sent_rows is not None:
        keep = min(keep, sent_rows)
    return max(keep, 0)


class SentRows:
    """The hidden-state rows a stage sent on for one request, by position (float32, grown as it goes)."""

    def __init__(self, most: int) -> None:
        self.most = most  # positions a request can have (the stage's context): the capacity never exceeds it
        self._rows: np.ndarray | None = None  # (capacity, width), made by the first put
        self.length = 0

    def put(self, start: int, rows: np.ndarray) -> None:
        """Rows for positions [start, start + len(rows)); what lay past them is dropped (it was rewritten)."""
        end = start + len(rows)
        if start > self.length:
            raise ValueError(f"rows from position {start} would leave a gap after {self.length}")
        have = 0 if self._rows is None else len(self._rows)
        if end > have:  # doubling: a request's steps add one row each
            grown = np.zeros((max(end, min(2 * have, self.most), 16), rows.shape[1]), np.float32)
            if self._rows is not None:
                grown[:self.length] = self._rows[:self.length]
            self._rows = grown
        assert self._rows is not None
        self._rows[start:end] = rows
        self.length = end

    @property
    def capacity(self) -> int:
        return 0 if self._rows is None else len(self._rows)

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)

    def upto(self, n: int) -> np.ndarray:
        """Rows [0, n)."""
        if n > self.length or self._rows is None:
            raise ValueError(f"rows up to {n} asked for, {self.length} kept")
        return self._rows[:n]
