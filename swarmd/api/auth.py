"""What every HTTP request must pass before a route sees it: the bearer token and the size limits.

A pure ASGI middleware around the daemon's Starlette app:
- with a token configured, every route except the open ones (`/health`, the web page) wants `Authorization: Bearer
  <token>`, compared in constant time; otherwise 401;
- a request body over `max_request_bytes` is refused with 413, by its Content-Length before it is read,
  or as soon as a chunked body goes over;
- a JSON body asking for more than `max_tokens` (`max_tokens`, `max_completion_tokens`) is refused with 400;
  a chat request that names no limit (OpenAI's default: until the context is full) gets `max_tokens`.

Errors have OpenAI's shape (`{"error": {"message", "type", "code", "param"}}`), which every client of this
API reads: the OpenAI clients, `swarmd status` and `swarmd submit-prompt`.
"""

from __future__ import annotations

import hmac
import json
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})  # and what `open` adds (the web page, which holds no data)
UNBOUNDED_BY_DEFAULT = frozenset({"/v1/chat/completions"})  # the other routes default to a few tokens
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
DRAIN_LIMIT = 16 * 1024 * 1024  # bytes of an over-limit body read and dropped before the 413


class ApiGuard:
    def __init__(self, app: ASGIApp, *, token: str = "", max_request_bytes: int, max_tokens: int,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.token = token.encode()
        self.max_request_bytes = max_request_bytes
        self.max_tokens = max_tokens
        self.open_paths = open_paths
        self.open_prefixes: tuple[str, ...] = ()
        self.stats: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if self.token and not self._open(scope["path"]) and not self._authorised(headers):
            self.stats["unauthorised"] += 1
            await _error(send, 401, "this API wants an API token: send 'Authorization: Bearer <token>' "
                                    "(swarmd clients: --api-token or SWARMD_API_TOKEN)",
                         "invalid_request_error", "invalid_api_key", extra=[(b"www-authenticate", b"Bearer")])
            return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_request_bytes):
            await self._too_large(send)
            return
        if scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                # Read the rest first (up to a bound): a reply sent while the client is still writing
                # is often lost to it as a reset connection.
                if message.get("more_body", False):
                    await _discard_body(receive, DRAIN_LIMIT)
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        problem, capped = self._token_limit(scope["path"], headers, bytes(body))
        if problem is not None:
            self.stats["max_tokens"] += 1
            await _error(send, 400, problem, "invalid_request_error", "max_tokens_limit", param="max_tokens")
            return
        if capped is not None:
            body = bytearray(capped)
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
                     + [(b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(bytes(body), receive), send)

    def open(self, paths: frozenset[str], prefix: str | None = None) -> None:
        """Serve `paths` (and every path under `prefix`) without a token."""
        self.open_paths = self.open_paths | paths
        if prefix:
            self.open_prefixes = (*self.open_prefixes, prefix)

    def _open(self, path: str) -> bool:
        return path in self.open_paths or any(path.startswith(p) and "/" not in path[len(p):]
                                              for p in self.open_prefixes)

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token)

    async def _too_large(self, send: Send) -> None:
        self.stats["too_large"] += 1
        await _error(send, 413, f"the request body is over the {self.max_request_bytes}-byte limit "
                                "(config key api-max-request-bytes)", "invalid_request_error", "request_too_large")

    def _token_limit(self, path: str, headers: dict[bytes, bytes], body: bytes) -> tuple[str | None, bytes | None]:
        """(why the body asks for too many tokens, or None; the body with a limit added, or None)."""
        if b"json" not in headers.get(b"content-type", b"json") or not body.lstrip().startswith(b"{"):
            return None, None
        try:
            doc = json.loads(body)
        except ValueError:
            return None, None  # the route answers malformed JSON itself
        if not isinstance(doc, dict):
            return None, None
        for field in TOKEN_FIELDS:
            value = doc.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > self.max_tokens:
                return (f"'{field}' is {value}; this daemon allows at most {self.max_tokens} tokens per request "
                        "(config key api-max-tokens)"), None
        if path in UNBOUNDED_BY_DEFAULT and all(doc.get(f) is None for f in TOKEN_FIELDS):
            return None, json.dumps({**doc, "max_tokens": self.max_tokens}).encode()
        return None, None


async def _discard_body(receive: Receive, limit: int) -> None:
    discarded = 0
    while discarded < limit:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        discarded += len(message.get("body", b""))


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", [])}


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then whatever comes next (a client going away is still seen)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _error(send: Send, status: int, message: str, kind: str, code: str, *, param: str | None = None,
                 extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": code, "param": param}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
