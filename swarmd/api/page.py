"""The swarm as a web page, served by every daemon at its API's root: the map, the experts, a token's
journey and a chat (`swarmd/api/static/`: plain HTML, CSS and JavaScript, no build step, nothing fetched from
elsewhere).

The page itself (`/` and `/ui/*`) is served without a token; it holds no data. Everything it shows it reads
from the API with the token the user typed once (kept in the tab's sessionStorage) as `Authorization: Bearer`:
`/api/v0/status` and `/api/v0/status/events` (the map, the experts), `/api/v0/traces` (a token's journey) and
`/v1/chat/completions` (the chat). A strict Content-Security-Policy keeps it to this origin.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from swarmd.api.app import Api
from swarmd.api.status_events import StatusEvents
from swarmd.api.swarm_map import live_descriptors, rtt_groups

PAGE_PATHS = frozenset({"/"})  # what the API guard lets through without a token, with PAGE_PREFIX
PAGE_PREFIX = "/ui/"
FILES = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8",
         "index.html": "text/html; charset=utf-8"}
HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def static_file(name: str) -> bytes:
    return (resources.files("swarmd.api") / "static" / name).read_bytes()


async def index(request: Request) -> Response:
    return Response(static_file("index.html"), media_type=FILES["index.html"], headers=HEADERS)


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in FILES:
        return PlainTextResponse(f"no {name} here\n", status_code=404)
    return Response(static_file(name), media_type=FILES[name], headers=HEADERS)


def serve_page(api: Api) -> None:
    """The page's files at `/` and `/ui/*`, open without the API token."""
    api.add_route("/", index)
    api.add_route(PAGE_PREFIX + "{name}", asset)
    api.open_page(PAGE_PATHS, PAGE_PREFIX)


def install_page(node: Any) -> StatusEvents:
    """Serve the page and what it reads beyond the existing routes on `node.api`: the status stream and the
    status document's `groups` section."""
    api: Api = node.api
    serve_page(api)
    events = StatusEvents(node.status, subscribe=lambda changed: node.swarm.state_listeners.append(changed))
    events.install(api)

    def groups() -> dict[str, Any]:
        options = node.plan_options
        return rtt_groups(live_descriptors(node.swarm), default_rtt_ms=options.default_rtt_ms,
                          group_rtt_ms=options.group_rtt_ms)

    node.status_parts["groups"] = groups
    return events
