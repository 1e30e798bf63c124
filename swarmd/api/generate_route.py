"""`POST /api/v0/generate`: the route `swarmd submit-prompt` streams from, one JSON object per line.

Body: exactly one of `prompt` (text, continued as is), `chat` (one user message through the model's chat
template), `messages` (a chat) or `prompt_ids`; and optionally `max_tokens` (default 128), `temperature`
(default 0: greedy, as `swarmd run`), `top_p`, `top_k`, `seed`, `stop`, `logprobs`, `trace`, `wait` (seconds
to wait for the swarm to be ready), `speculate` ({"mode": "off" | "ngram" | "model:NAME", "draft_tokens": K}; the
daemon's `--speculate` by default). Events, in order:

    {"event": "waiting", "detail": "plan epoch 2: loading stage 1 (blocks 8-15, ...)"}   (while it waits)
    {"event": "waiting", "detail": "queued: 3 requests ahead, waiting for a free slot"}  (its turn in the queue)
    {"event": "start", "request_id": ..., "prompt_tokens": 12, "seed": ...}
    {"event": "token", "step": 0, "id": 1824, "text": " Paris"}                          (one per token)
    {"event": "done", "finish_reason": "stop", "text": "", "usage": {...}, "timings": {...}, "trace": [...]}
or  {"event": "error", "code": "timeout", "message": "..."}
    ({"event": "error", "code": "queue_full", "message": ..., "retry_after": 5}: pushed out of a full queue)

A body that cannot be served is answered at once with an HTTP error and `{"error": {...}}` instead: 429 with
`Retry-After` when this daemon's queue is full.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmd.api.app import Api
from swarmd.api.openai_format import ApiError, integer_field, number_field, speculate_field, stop_field
from swarmd.api.openai_routes import guarded, render_chat
from swarmd.api.streaming import EventStream, Write, ndjson, read_json
from swarmd.api.turns import admit
from swarmd.inference.head.admission import Turn
from swarmd.inference.head.service import HeadError, HeadRequest, HeadService, ModelInfo, check_request
from swarmd.inference.head.session import Failed, Finished, TokenOut

DEFAULT_MAX_TOKENS = 128


def parse_generate(body: Any, model: ModelInfo) -> tuple[HeadRequest, float | None]:
    """The head request and the readiness wait (seconds, None: the daemon's default) of a generate body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    given = [k for k in ("prompt", "chat", "messages", "prompt_ids") if body.get(k) is not None]
    if len(given) != 1:
        raise ApiError(400, "give exactly one of 'prompt', 'chat', 'messages' or 'prompt_ids'")
    kind = given[0]
    if kind == "prompt_ids":
        ids = body["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ApiError(400, "'prompt_ids' must be a list of token ids", param="prompt_ids")
    else:
        value = body[kind]
        if kind == "messages":
            text = render_chat(model, value if isinstance(value, list) else [])
        elif not isinstance(value, str):
            raise ApiError(400, f"'{kind}' must be a string", param=kind)
        elif kind == "chat":
            text = render_chat(model, [{"role": "user", "content": value}])
        else:
            text = value
        ids = model.tokenizer.encode(text) if text else []
    top_k = integer_field(body, "top_k", 0, 0, 1 << 20) or 0
    seed = integer_field(body, "seed", None, 0, (1 << 63) - 1)
    max_tokens = integer_field(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, 1 << 20)
    assert max_tokens is not None
    trace = body.get("trace") is True
    wait = body.get("wait")
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0):
        raise ApiError(400, "'wait' must be a number of seconds", param="wait")
    req = HeadRequest(tuple(ids), max_tokens, number_field(body, "temperature", 0.0, 0.0, 100.0),
                      number_field(body, "top_p", 1.0, 0.0, 1.0) or 1.0, top_k, seed, stop_field(body),
                      logprobs=integer_field(body, "logprobs", 0, 0, 20) or 0, trace=trace,
                      speculate=speculate_field(body))
    return req, None if wait is None else float(wait)


class GenerateRoute:
    def __init__(self, head: HeadService) -> None:
        self.head = head

    def install(self, api: Api) -> None:
        api.add_route("/api/v0/generate", guarded(self.generate), methods=("POST",))

    async def generate(self, request: Request) -> Response:
        try:
            model = await self.head.model()
            try:
                body = await read_json(request)
            except ValueError as e:
                raise ApiError(400, str(e), code="invalid_json") from None
            tokenize_start = time.perf_counter()
            req, wait = parse_generate(body, model)
            tokenized = (tokenize_start, time.perf_counter())
            check_request(req, model)
            await self.head.check_speculation(req, model)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except HeadError as e:
            return JSONResponse(ApiError(e.status, e.message, code=e.code).body(), status_code=e.status)
        turn = admit(self.head, request, body)
        if isinstance(turn, Response):
            return turn
        return EventStream(lambda write: self._produce(write, req, wait, turn, tokenized), "application/x-ndjson",
                           closing=lambda: self.head.close_turn(turn))

    async def _produce(self, write: Write, req: HeadRequest, wait: float | None, turn: Turn,
                       tokenized: tuple[float, float] = (0.0, 0.0)) -> None:
        async def on_wait(detail: str) -> None:
            await write(ndjson({"event": "waiting", "detail": detail}))

        try:
            async with self.head.open(req, turn=turn, on_wait=on_wait, ready_timeout=wait) as handle:
                handle.record("tokenize", *tokenized, prompt_tokens=handle.prompt_tokens)
                await write(ndjson({"event": "start", "request_id": handle.request_id,
                                    "prompt_tokens": handle.prompt_tokens, "seed": handle.seed}))
                async for ev in handle:
                    if isinstance(ev, TokenOut):
                        await write(ndjson({"event": "token", "step": ev.step, "id": ev.token_id, "text": ev.text,
                                            **({"logprob": ev.logprob, "top": ev.top} if req.logprobs else {})}))
                    elif isinstance(ev, Finished):
                        done: dict[str, Any] = {"event": "done", "finish_reason": ev.reason, "text": ev.text,
                                                "usage": handle.usage(), "timings": handle.timing.to_json()}
                        if handle.recoveries:
                            done["recoveries"] = [r.to_json() for r in handle.recoveries]
                        if handle.spec is not None:
                            done["speculation"] = {"mode": handle.spec.settings.mode, **handle.spec.stats.to_json()}
                        if handle.recorder is not None:
                            done["trace"] = await self.head.trace(handle)
                        await write(ndjson(done))
                    elif isinstance(ev, Failed):
                        await write(ndjson({"event": "error", "code": ev.code, "message": ev.message}))
        except HeadError as e:
            retry = {"retry_after": e.retry_after} if e.retry_after is not None else {}
            await write(ndjson({"event": "error", "code": e.code, "message": e.message, **retry}))
