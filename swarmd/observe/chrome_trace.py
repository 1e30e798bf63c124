"""Chrome trace-event JSON (opens in Perfetto and chrome://tracing): the file `swarmd submit-prompt --trace` writes.

A `Tracer` holds complete events (`ph: "X"`) and instants (`ph: "i"`) with microsecond timestamps on one
clock. The daemons do not trace with it directly: they record spans of traced requests only
(`swarmd.observe.spans.SpanRecorder.add`), and the head turns them into these events
(`swarmd.observe.spans.chrome_trace`).

    {"traceEvents": [{"name": "head.prefill", "ph": "X", "ts": 12.0, "dur": 830.5, "pid": 1, "tid": 1,
                      "args": {"request_id": "...", "step": 0}}, ...],
     "displayTimeUnit": "ms"}

Events carry `pid` (one per daemon, named by a metadata event) and `tid` (one per actor on it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class Tracer:
    def __init__(self, process: str, *, pid: int = 1, clock=time.perf_counter) -> None:
        self.pid = pid
        self._clock = clock
        self._threads: dict[str, int] = {}
        self.events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}},
        ]

    def now_us(self) -> float:
        return self._clock() * 1e6

    def thread_id(self, thread: str) -> int:
        tid = self._threads.get(thread)
        if tid is None:
            tid = self._threads[thread] = len(self._threads) + 1
            self.events.append({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                                "args": {"name": thread}})
        return tid

    def complete(self, name: str, start_us: float, end_us: float, *, thread: str = "head", **args: Any) -> None:
        self.events.append({"name": name, "ph": "X", "ts": round(start_us, 1), "dur": round(end_us - start_us, 1),
                            "pid": self.pid, "tid": self.thread_id(thread), "args": args})

    def instant(self, name: str, *, thread: str = "head", **args: Any) -> None:
        self.events.append({"name": name, "ph": "i", "s": "t", "ts": round(self.now_us(), 1), "pid": self.pid,
                            "tid": self.thread_id(thread), "args": args})

    def to_json(self) -> dict[str, Any]:
        return {"traceEvents": list(self.events), "displayTimeUnit": "ms"}


def write_trace(path: str | Path, events: list[dict[str, Any]]) -> None:
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")
