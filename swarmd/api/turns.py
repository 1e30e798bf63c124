"""A generation request's place in its head's queue, taken before the HTTP response starts.

`take_turn` asks the head for a place (`HeadService.admit`) and waits for the request's turn while watching
the connection: a client that goes away leaves the queue. What cannot wait is answered at once, in OpenAI's
error shape: 429 with `Retry-After` when the queue is full (or the request was pushed out of it), 503 when the
swarm cannot serve. A client is the OpenAI `user` field when the body gives one, else the peer's address.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmd.api.openai_format import ApiError
from swarmd.api.streaming import until_disconnect
from swarmd.inference.head.admission import Turn
from swarmd.inference.head.service import HeadError, HeadService


def client_key(request: Request, body: Any = None) -> str:
    """Who a request comes from, for the queue's fairness: the body's OpenAI `user` field, else the address."""
    user = body.get("user") if isinstance(body, dict) else None
    if isinstance(user, str) and user:
        return f"user:{user[:128]}"
    return f"addr:{request.client.host if request.client else '-'}"


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def api_error_of(e: HeadError) -> ApiError:
    return ApiError(e.status, e.message, code=e.code, retry_after=e.retry_after)


def admit(head: HeadService, request: Request, body: Any) -> Turn | Response:
    """A place in the queue, or the 429 / 503 to answer with."""
    try:
        return head.admit(client_key(request, body))
    except HeadError as e:
        return error_response(api_error_of(e))


async def take_turn(head: HeadService, request: Request, body: Any) -> Turn | Response:
    """The request's place once it is its turn (the chain has a slot for it on every stage), or the response
    to give instead (429, 503; 499 when the client went away while it waited). A returned turn is the caller's
    to close."""
    turn = admit(head, request, body)
    if isinstance(turn, Response):
        return turn
    try:
        granted = await until_disconnect(request, lambda: head.wait_turn(turn))
    except HeadError as e:
        head.close_turn(turn)
        return error_response(api_error_of(e))
    except BaseException:
        head.close_turn(turn)
        raise
    if granted is None:
        head.close_turn(turn)
        return Response(status_code=499)
    return turn
