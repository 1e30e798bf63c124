"""Clock offsets between daemons, estimated NTP-style from timestamped probes. Sans-IO.

A probe carries four readings: t0 (we sent it, our clock), t1 (the peer received it, its clock), t2 (the
peer answered, its clock), t3 (the answer came back, our clock). If the way there and the way back take
the same time, the peer's clock reads ahead of ours by

    offset = ((t1 - t0) + (t2 - t3)) / 2      with round-trip delay = (t3 - t0) - (t2 - t1)

and however asymmetric the two ways are, the true offset lies within delay / 2 of it. Like NTP's clock
filter, the estimate is the offset of the sample with the smallest delay among the recent ones: queueing
only ever adds delay, so the fastest exchange is the one least skewed by it.

Daemons of one machine share `time.perf_counter` (CLOCK_MONOTONIC on Linux), so between them the offset
is about zero; across machines it is whatever their monotonic clocks started at.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

KEEP = 16  # samples per peer the filter picks from (probes come every few seconds: about a minute of them)


@dataclass(frozen=True)
class ClockSample:
    offset: float  # s the peer's clock reads ahead of ours
    delay: float  # s round trip, minus the time the peer held the probe

    @classmethod
    def of(cls, t0: float, t1: float, t2: float, t3: float) -> ClockSample:
        return cls(((t1 - t0) + (t2 - t3)) / 2, max(0.0, (t3 - t0) - (t2 - t1)))

    @property
    def error(self) -> float:
        """The most the true offset can differ from `offset` (half the delay)."""
        return self.delay / 2


class ClockOffsets:
    """Per peer, the best recent sample of how far its clock is from ours."""

    def __init__(self, keep: int = KEEP) -> None:
        self._samples: dict[str, deque[ClockSample]] = {}
        self._keep = keep

    def add(self, peer: str, t0: float, t1: float, t2: float, t3: float) -> ClockSample | None:
        """Record one exchange; ignored (None) when its readings are impossible (t3 before t0, t2 before t1)."""
        if not (t3 >= t0 and t2 >= t1):
            return None
        sample = ClockSample.of(t0, t1, t2, t3)
        self._samples.setdefault(peer, deque(maxlen=self._keep)).append(sample)
        return sample

    def best(self, peer: str) -> ClockSample | None:
        samples = self._samples.get(peer)
        return min(samples, key=lambda s: s.delay) if samples else None

    def offset(self, peer: str) -> float | None:
        """Seconds to subtract from the peer's clock readings to put them on ours; None before any probe."""
        best = self.best(peer)
        return None if best is None else best.offset

    def forget(self, peer: str) -> None:
        self._samples.pop(peer, None)

    def to_json(self) -> dict[str, dict[str, float]]:
        out = {}
        for peer in self._samples:
            best = self.best(peer)
            if best is not None:
                out[peer] = {"offset_ms": round(best.offset * 1e3, 4), "error_ms": round(best.error * 1e3, 4)}
        return out
