"""What a stage's worker hands around: the loaded stage (`Loaded`), one admitted step (`Job`) and the jobs on the
compute thread together (`Batch`). The actor (`swarmd.inference.stage.actor`) makes them; the batch code
(`swarmd.inference.stage.batch`) runs them.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from swarmd.inference.registry import Registry
from swarmd.inference.stage.book import Sampled, StageBook, Work
from swarmd.transport.transport import Send


@dataclass(frozen=True)
class Loaded:
    """This daemon's stage as the plan and the assignment have it now."""

    model: Any  # models.stage.StageModel
    hop: int
    registry: Registry


@dataclass
class Job:
    work: Work
    model: Any
    loaded: Loaded | None = None  # the stage and book it was admitted to
    book: StageBook | None = None
    received: float = 0.0  # perf_counter seconds (one clock for every process of a machine): message in,
    taken: float = 0.0  # handed to the compute thread in a batch, the model began the batch, the model was done
    started: float = 0.0
    ended: float = 0.0
    computed: float = 0.0  # the model's forward was done (sampling, on the last stage, comes after)
    arrived: float = 0.0  # a hot step's bytes came off the socket (the lane's reader), before `received`
    done: trio.Event = field(default_factory=trio.Event)
    output: np.ndarray | Sampled | None = None
    error: tuple[str, str] | None = None  # (code, message)
    booked: bool = False  # the book's transition for its output was made (`StageBook.completed`)
    batch: int = 1
    group: list[Job] = field(default_factory=list)  # the jobs of the batch it ran in (itself included)
    sends: tuple[Send, ...] | None = None  # its outputs, once built (with the rest of its batch's)
    reply: Any = None  # a lane frame's later answer (`swarmd.transport.lane.Reply`): a hot step the worker finishes
    offset: int = 0  # rows of `work` the model has run (a long prefill runs a chunk per batch)
    take: int = 0  # rows it runs in the batch it is in (0: all the rest)
    parts: list[np.ndarray] = field(default_factory=list)  # outputs of its earlier chunks that the step returns

    @property
    def rows_left(self) -> int:
        return self.work.rows - self.offset


@dataclass(eq=False)
class Batch:
    """Jobs on the compute thread: `run_batch`'s steps and the answer to its first segment once it is in."""

    jobs: list[Job]
    steps: Generator[Any, Any, None]
    answer: tuple[bool, Any] = (False, None)  # advance's (done, next question)
    error: BaseException | None = None
    arrived: trio.Event = field(default_factory=trio.Event)
    hot: bool = False  # started by a lane's reader thread (`StageActor.take_hot`), which records it
    resume: tuple[Any, BaseException | None] | None = None  # a hot step's expert answer (or error) the worker
    # resumes it with
    asking: trio.CancelScope | None = None  # the worker's wait for the step's remote experts
    fan: Any = None  # the hot fan-out (moe.fan_out.FanOut) the step waits on
    settled: bool = False  # its jobs were woken, or put back for their next chunk
