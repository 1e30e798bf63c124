"""The HTTP API behind its guard, over a real socket: the bearer token, request size and max_tokens limits,
and the rule that an API reachable from other machines needs a token."""

from __future__ import annotations

import httpx
import pytest
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse

from swarmd.api.app import Api
from swarmd.errors import UserError
from swarmd.net.access import check_api_binding

TOKEN = "s3cret-token-0123456789"


async def serve(nursery: trio.Nursery, **limits) -> str:
    api = Api(token=TOKEN, **limits)

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"got": await request.json()})

    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    api.add_route("/health", ok)
    api.add_route("/api/v0/status", ok)
    api.add_route("/v1/completions", echo, methods=("POST",))
    api.add_route("/v1/chat/completions", echo, methods=("POST",))
    return await nursery.start(api.serve, "127.0.0.1:0")


async def test_every_route_but_health_wants_the_token():
    async with trio.open_nursery() as nursery:
        url = await serve(nursery, max_request_bytes=4096, max_tokens=64)
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/health")).status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}):
                r = await client.get("/api/v0/status", headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
                r = await client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
                assert r.status_code == 401
            good = {"Authorization": f"Bearer {TOKEN}"}
            assert (await client.get("/api/v0/status", headers=good)).json() == {"ok": True}
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 64}, headers=good)
            assert r.json() == {"got": {"prompt": "hi", "max_tokens": 64}}  # the route sees the body intact
        nursery.cancel_scope.cancel()


async def test_oversized_bodies_and_too_many_tokens_are_refused_before_any_route_runs():
    async with trio.open_nursery() as nursery:
        url = await serve(nursery, max_request_bytes=4096, max_tokens=64)
        good = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=url, headers=good) as client:
            r = await client.post("/v1/completions", json={"prompt": "x" * 5000})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

            async def chunks():  # no Content-Length: the limit applies as the body arrives
                for _ in range(10):
                    yield b"x" * 1000

            r = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413
            for field in ("max_tokens", "max_completion_tokens"):
                r = await client.post("/v1/completions", json={"prompt": "hi", field: 65})
                assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
                assert "at most 64" in r.json()["error"]["message"]
            # A chat asks for no limit (OpenAI's default: until the context is full): it gets the daemon's.
            r = await client.post("/v1/chat/completions", json={"messages": []})
            assert r.json() == {"got": {"messages": [], "max_tokens": 64}}
            r = await client.post("/v1/chat/completions", json={"messages": [], "max_completion_tokens": 5})
            assert r.json() == {"got": {"messages": [], "max_completion_tokens": 5}}
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("bind", ["127.0.0.1:8765", "[::1]:8765", "localhost:8765"])
def test_loopback_needs_no_token(bind):
    check_api_binding(bind, "")


def test_an_api_reachable_from_other_machines_needs_a_token_that_cannot_be_guessed():
    with pytest.raises(UserError, match="--api-token"):
        check_api_binding("0.0.0.0:8765", "")
    with pytest.raises(UserError, match="--api-token"):
        check_api_binding("10.1.2.3:8765", "")
    with pytest.raises(UserError, match="at least 16"):
        check_api_binding("0.0.0.0:8765", "short")
    check_api_binding("0.0.0.0:8765", TOKEN)
