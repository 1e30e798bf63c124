"""`GET /api/v0/status/events`: the status document as server-sent events, for the web page's live map.

One event at once, then one whenever a member changes state (alive, suspect, dead: at most every
`min_gap` seconds), and at least every `interval` seconds for what changes without an event (load, memory, the
plan). The page renders its first view from a plain `GET /api/v0/status` and follows this stream after.

    data: {"self": {...}, "members": [...], "plan": {...}, ...}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmd.api.app import Api
from swarmd.api.streaming import EventStream, Write, sse

INTERVAL = 1.0  # s between events when nothing changes
MIN_GAP = 0.1  # s at least between two events


class StatusEvents:
    def __init__(self, status: Callable[[], dict[str, Any]], *,
                 subscribe: Callable[[Callable[..., None]], None] | None = None, interval: float = INTERVAL,
                 min_gap: float = MIN_GAP) -> None:
        self.status = status
        self.subscribe = subscribe  # adds a listener of membership changes (once the swarm runs)
        self.interval = interval
        self.min_gap = min_gap
        self._waiting: set[trio.Event] = set()

    def changed(self, *_: Any) -> None:
        """Something the map shows changed (a membership listener): wake every stream."""
        for event in self._waiting:
            event.set()

    def install(self, api: Api) -> None:
        api.add_route("/api/v0/status/events", self.events)

    async def events(self, request: Request) -> Response:
        try:
            first = self.status()
        except AssertionError:  # the daemon is still starting
            return JSONResponse({"error": {"message": "the daemon is starting", "type": "server_error",
                                           "code": "starting", "param": None}}, status_code=503)
        if self.subscribe is not None:
            self.subscribe(self.changed)
            self.subscribe = None
        return EventStream(lambda write: self._stream(write, first), "text/event-stream")

    async def _stream(self, write: Write, first: dict[str, Any]) -> None:
        doc = first
        while True:
            woken = trio.Event()  # listening before the write: a change while it is sent is not missed
            self._waiting.add(woken)
            try:
                await write(sse(doc))
                await trio.sleep(self.min_gap)
                with trio.move_on_after(self.interval - self.min_gap):
                    await woken.wait()
            finally:
                self._waiting.discard(woken)
            doc = self.status()
