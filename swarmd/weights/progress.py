"""How far a fetch got: bytes, rate over the last seconds, time left (sans-IO; the clock is passed in)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

RATE_WINDOW = 5.0  # seconds the rate is averaged over


@dataclass
class FetchProgress:
    total: int = 0  # bytes the fetch lacked when it started
    done: int = 0  # of those, fetched so far
    sources: int = 0  # peers being fetched from now
    waiting: str = ""  # why it is not moving, when it is not
    started: float = 0.0
    finished: float | None = None
    _samples: deque[tuple[float, int]] = field(default_factory=deque)

    def start(self, total: int, now: float) -> None:
        self.total, self.done, self.started, self.finished = total, 0, now, None
        self._samples.clear()
        self._samples.append((now, 0))

    def add(self, nbytes: int, now: float) -> None:
        self.done += nbytes
        self._samples.append((now, self.done))
        while len(self._samples) > 2 and self._samples[1][0] < now - RATE_WINDOW:
            self._samples.popleft()

    def finish(self, now: float) -> None:
        self.finished = now

    @property
    def active(self) -> bool:
        return self.total > 0 and self.finished is None

    def rate(self, now: float) -> float:
        """Bytes per second over the last RATE_WINDOW seconds (the whole fetch when finished)."""
        if self.finished is not None:
            took = self.finished - self.started
            return self.done / took if took > 0 else 0.0
        if not self._samples:
            return 0.0
        t0, b0 = self._samples[0]
        span = max(now - t0, 1e-3)
        return (self.done - b0) / span

    def eta(self, now: float) -> float | None:
        rate = self.rate(now)
        if not self.active:
            return 0.0
        return (self.total - self.done) / rate if rate > 0 else None

    def to_json(self, now: float) -> dict[str, Any]:
        eta = self.eta(now)
        return {"active": self.active, "bytes": self.done, "total": self.total,
                "rate_bytes_per_s": round(self.rate(now), 1), "eta_s": None if eta is None else round(eta, 1),
                "sources": self.sources, "waiting": self.waiting,
                "seconds": round((self.finished if self.finished is not None else now) - self.started, 3)
                if self.total else 0.0}
