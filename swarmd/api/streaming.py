"""HTTP plumbing for generation routes: a streamed response that stops when the client goes away.

Starlette's own `StreamingResponse` iterates an async generator, whose clean-up (the `Cancel` down the chain)
would run only when the generator is collected. `EventStream` instead runs `produce(write)` in a nursery next
to a task that waits for `http.disconnect`: when the client leaves, `produce` is cancelled where it waits,
and its `async with head.open(...)` block sends the cancel at once. `until_disconnect` does the same for a
non-streamed answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)
Write = Callable[[bytes], Awaitable[None]]
T = TypeVar("T")


class EventStream(Response):
    """A 200 response whose body `produce(write)` writes piece by piece (SSE or NDJSON)."""

    def __init__(self, produce: Callable[[Write], Awaitable[None]], media_type: str,
                 headers: Mapping[str, str] | None = None) -> None:
        self.produce = produce
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        gone = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone = True
                nursery.cancel_scope.cancel()

            async def write(chunk: bytes) -> None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

            nursery.start_soon(watch)
            try:
                await self.produce(write)
            except OSError:  # the connection broke under a write
                gone = True
            except Exception:  # the status is sent: all that is left is to end the body and log why
                log.exception("a streamed response failed")
            nursery.cancel_scope.cancel()
        if not gone:
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """`await work()`, cancelled if the client disconnects first (then None). What `work` raises is raised
    as it is (not inside an exception group)."""
    done: list[T] = []
    failed: list[Exception] = []
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            done.append(await work())
        except Exception as e:
            failed.append(e)
        nursery.cancel_scope.cancel()
    if failed:
        raise failed[0]
    return done[0] if done else None


async def read_json(request: Request) -> Any:
    """The request body as JSON; ValueError with a readable reason if it is not."""
    body = await request.body()
    if not body.strip():
        raise ValueError("the request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError:
        raise ValueError("the request body is not UTF-8 text") from None


def sse(data: Any) -> bytes:
    """One server-sent event carrying `data` as JSON (or a literal string such as "[DONE]")."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def ndjson(data: Any) -> bytes:
    return (json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
