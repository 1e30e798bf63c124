"""The last durations of something a status reports, and their median.

Added to from any thread (a lane's readers among them) and read on the event loop: a deque's append and its copy
into a list are each one step under the GIL.
"""

from __future__ import annotations

from collections import deque

KEEP = 512  # durations kept


class RecentTimes:
    def __init__(self, keep: int = KEEP) -> None:
        self._ms: deque[float] = deque(maxlen=keep)

    def add(self, seconds: float) -> None:
        self._ms.append(seconds * 1e3)

    def median_ms(self) -> float | None:
        """The median of the durations kept, in ms (None before the first)."""
        ordered = sorted(self._ms)
        return round(ordered[len(ordered) // 2], 3) if ordered else None
