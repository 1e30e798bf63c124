"""The head's recent traces: the merged Chrome trace of its last traced requests, bounded in count and size.

`TraceCollector.collect` puts each merged trace here; `GET /api/v0/traces` lists them (newest first) and
`GET /api/v0/traces/{request_id}` serves one as Chrome trace-event JSON (what Perfetto opens, and what the web
page draws a token's waterfall from). The oldest go first when there are more than `keep` traces or more than
`max_events` events in all (a long request's trace alone can be large).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

KEEP_TRACES = 20
MAX_EVENTS = 400_000  # in all the kept traces: about 100 MB of JSON at most


@dataclass(frozen=True)
class KeptTrace:
    request_id: str
    finished: float  # unix time the trace was merged
    events: list[dict[str, Any]]
    summary: dict[str, Any]  # what the list shows of it (`summarize`)

    def chrome_json(self) -> dict[str, Any]:
        return {"traceEvents": self.events, "displayTimeUnit": "ms",
                "otherData": {"request_id": self.request_id, "finished": round(self.finished, 3)}}


def summarize(request_id: str, finished: float, events: list[dict[str, Any]]) -> dict[str, Any]:
    """A trace in a line: when, how many tokens and steps, which daemons (their process names), how long."""
    nodes = [e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"]
    tokens = sum(1 for e in events if e.get("ph") == "i" and e.get("name") == "token")
    spans = [e for e in events if e.get("ph") == "X"]
    steps = {e["args"]["step"] for e in spans if isinstance(e.get("args", {}).get("step"), int)}
    start = min((e["ts"] for e in spans), default=0.0)
    end = max((e["ts"] + e["dur"] for e in spans), default=0.0)
    return {"request_id": request_id, "finished": round(finished, 3), "tokens": tokens, "steps": len(steps),
            "nodes": nodes, "duration_ms": round((end - start) / 1e3, 3), "events": len(events)}


class TraceStore:
    def __init__(self, *, keep: int = KEEP_TRACES, max_events: int = MAX_EVENTS) -> None:
        self.keep = keep
        self.max_events = max_events
        self._traces: OrderedDict[str, KeptTrace] = OrderedDict()
        self._events = 0

    def put(self, request_id: str, events: list[dict[str, Any]], *, finished: float | None = None) -> None:
        self._drop(request_id)
        when = time.time() if finished is None else finished
        self._traces[request_id] = KeptTrace(request_id, when, events, summarize(request_id, when, events))
        self._events += len(events)
        while len(self._traces) > 1 and (len(self._traces) > self.keep or self._events > self.max_events):
            self._drop(next(iter(self._traces)))

    def _drop(self, request_id: str) -> None:
        old = self._traces.pop(request_id, None)
        if old is not None:
            self._events -= len(old.events)

    def get(self, request_id: str) -> list[dict[str, Any]] | None:
        """The trace's events, or None if it is not kept."""
        kept = self._traces.get(request_id)
        return None if kept is None else kept.events

    def kept(self, request_id: str) -> KeptTrace | None:
        return self._traces.get(request_id)

    def recent(self) -> list[KeptTrace]:
        """Newest first."""
        return list(reversed(self._traces.values()))

    def __len__(self) -> int:
        return len(self._traces)
