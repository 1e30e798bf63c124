"""The cyclic garbage collections this process's compute thread ran between jobs (`swarmd.inference.compute`
records them, /metrics shows them): each one holds the interpreter lock, so a step's output waits for it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Collections:
    """The cyclic collections this process's compute thread ran between jobs, per generation (0, 1, 2)."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])

    def record(self, generation: int, seconds: float) -> None:
        self.count[generation] += 1
        self.seconds[generation] += seconds
        self.longest[generation] = max(self.longest[generation], seconds)


COLLECTIONS = Collections()
