"""The daemon's local HTTP API: a Starlette app served by hypercorn's trio worker.

Other parts of the daemon add their routes before or after start with `Api.add_route` (the
pipeline adds `/v1/*` and `/api/v0/generate`); the node adds `/api/v0/status`, `/health` and
`/metrics`. The listening socket is bound here, so a port in use is one clear error line. Every request
passes `swarmd.api.auth.ApiGuard` first: the bearer token (when one is set) and the size limits.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route

from swarmd.api.auth import ApiGuard
from swarmd.config import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS, parse_api_address
from swarmd.errors import UserError

log = logging.getLogger(__name__)


def api_url(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"http://[{host}]:{port}"
    except ValueError:
        pass
    return f"http://{host}:{port}"


class Api:
    def __init__(self, *, token: str = "", max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.app = Starlette(routes=[])
        self.token = token
        self.guard = ApiGuard(self.app, token=token, max_request_bytes=max_request_bytes, max_tokens=max_tokens)
        self.url: str | None = None

    @property
    def guard_stats(self) -> dict[str, int]:
        """Requests refused before any route saw them, by reason."""
        return dict(self.guard.stats)

    def add_route(self, path: str, endpoint: Callable[..., Any], methods: Sequence[str] = ("GET",),
                  name: str | None = None) -> None:
        """Serve `endpoint` (a Starlette request handler, sync or async) at `path`."""
        self.app.router.routes.append(Route(path, endpoint, methods=list(methods), name=name))

    def open_page(self, paths: frozenset[str], prefix: str | None = None) -> None:
        """Serve `paths` and everything under `prefix` without the API token (a page that holds no data)."""
        self.guard.open(paths, prefix)

    def add_routes(self, routes: Sequence[BaseRoute]) -> None:
        self.app.router.routes.extend(routes)

    async def serve(self, bind: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve on `bind` until cancelled; `task_status.started(url)` once the socket listens."""
        from hypercorn.config import Config
        from hypercorn.trio import serve

        host, port = parse_api_address(bind)
        sock = _bind(host, port)
        bound_host, bound_port = sock.getsockname()[:2]
        config = Config()
        config.bind = [f"fd://{sock.detach()}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.graceful_timeout = 1.0
        logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
        shutdown = trio.Event()
        self.url = api_url(bound_host, bound_port)
        async with trio.open_nursery() as nursery:
            await nursery.start(_serve_task, serve, self.guard, config, shutdown)
            task_status.started(self.url)
            try:
                await trio.sleep_forever()
            finally:
                shutdown.set()
                nursery.cancel_scope.cancel()


async def _serve_task(serve, app, config, shutdown: trio.Event, task_status=trio.TASK_STATUS_IGNORED) -> None:
    await serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--api {host}:{port}: cannot resolve {host!r} ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        with contextlib.suppress(OSError):
            sock.close()
        why = "the port is in use (pass --api 127.0.0.1:0 for any free port)" if e.errno == 98 else e.strerror
        raise UserError(f"--api {host}:{port}: cannot listen: {why}") from None
    return sock
