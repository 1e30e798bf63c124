"""What bounds what one peer can make a daemon do: a token bucket and a strike window (sans-IO: `now` comes in)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class StrikeCounter:
    """True once more than `limit` strikes fall within `window` seconds."""

    limit: int
    window: float
    _times: deque[float] = field(default_factory=deque)

    def strike(self, now: float) -> bool:
        self._times.append(now)
        while self._times and self._times[0] <= now - self.window:
            self._times.popleft()
        return len(self._times) > self.limit


@dataclass
class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; `take` says how long to wait for one."""

    rate: float
    burst: float
    _tokens: float | None = None  # None until first used: it starts full; negative is a debt being waited off
    _at: float = 0.0

    def try_take(self, now: float) -> bool:
        """Take a token only if one is there now."""
        if self.take(now) == 0.0:
            return True
        self.give_back()
        return False

    def give_back(self) -> None:
        assert self._tokens is not None
        self._tokens += 1.0

    def take(self, now: float) -> float:
        if self._tokens is None:
            self._tokens, self._at = self.burst, now
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate
