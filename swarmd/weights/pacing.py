"""How fast this daemon serves weights: one byte rate shared by every stream it serves them on (sans-IO).

Serving weights must never starve activations: a daemon serves at most `rate` bytes per second, and at
most `busy_rate` while requests run through it (see `swarmd.weights.server`). A sender reserves its bytes
and waits the delay it is given; a short burst (`burst_s` seconds' worth) goes out at once.
"""

from __future__ import annotations


class Pacer:
    def __init__(self, rate: float, busy_rate: float | None = None, burst_s: float = 0.05) -> None:
        """Rates in bytes per second; 0 or less is no limit."""
        self.rate = rate
        self.busy_rate = rate if busy_rate is None else busy_rate
        self.burst_s = burst_s
        self._next = float("-inf")  # when the bytes reserved so far have all gone out

    def reserve(self, nbytes: int, now: float, busy: bool = False) -> float:
        """Seconds to wait before sending `nbytes` (0: send now)."""
        rate = self.busy_rate if busy else self.rate
        if rate <= 0:
            return 0.0
        start = max(self._next, now - self.burst_s)
        self._next = start + nbytes / rate
        return max(0.0, start - now)
