"""OpenAI-compatible routes on every daemon: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each request is headed by this daemon (`swarmd.inference.head.service`): parsed and checked (`swarmd.api.openai_format`), the
prompt tokenized, the chain waited for (a 503 in OpenAI's error shape if it is not ready in time), then
generated, streamed as server-sent events ending in `data: [DONE]` or answered as one JSON object. A client
that disconnects cancels its request along the chain. With the header `X-Swarmd-Trace: 1` the request is traced:
its merged trace is kept for `GET /api/v0/traces/{id}` before the answer ends (`data: [DONE]`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmd.api.app import Api
from swarmd.api.openai_format import (
    ApiError,
    ChatCall,
    CompletionCall,
    LegacyLogprobs,
    chat_body,
    chat_chunk,
    chat_logprob_entry,
    completion_body,
    model_card,
    models_list,
    new_id,
    parse_chat,
    parse_completion,
    usage_chunk,
)
from swarmd.api.streaming import EventStream, Write, read_json, sse, until_disconnect
from swarmd.inference.head.service import (
    HeadError,
    HeadRequest,
    HeadService,
    ModelInfo,
    check_request,
    status_of,
)
from swarmd.inference.head.session import Failed, Finished, PromptScores, TokenOut

log = logging.getLogger(__name__)


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def api_error(e: HeadError | Failed) -> ApiError:
    status = e.status if isinstance(e, HeadError) else status_of(e.code)
    return ApiError(status, e.message, code=e.code)


class OpenAIRoutes:
    def __init__(self, head: HeadService) -> None:
        self.head = head
        self.created = int(time.time())

    def install(self, api: Api) -> None:
        api.add_route("/v1/models", guarded(self.models))
        api.add_route("/v1/models/{model:path}", guarded(self.model))
        api.add_route("/v1/completions", guarded(self.completions), methods=("POST",))
        api.add_route("/v1/chat/completions", guarded(self.chat), methods=("POST",))

    # --- models ----------------------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        try:
            model = await self.head.model()
        except HeadError as e:
            return error_response(api_error(e))
        return JSONResponse(models_list(model.name, self.created))

    async def model(self, request: Request) -> Response:
        try:
            model = await self.head.model()
        except HeadError as e:
            return error_response(api_error(e))
        name = request.path_params["model"]
        if name != model.name:
            return error_response(ApiError(404, f"The model '{name}' does not exist: this swarm serves "
                                                f"'{model.name}'", code="model_not_found", param="model"))
        return JSONResponse(model_card(model.name, self.created))

    # --- completions ----------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        try:
            model = await self.head.model()
            call = parse_completion(await _json(request), model.name)
            ids = call.prompt_ids if call.prompt_ids is not None else tuple(model.tokenizer.encode(call.prompt_text))
            req = call.head_request(ids, trace=traced(request))
            await self._check_and_wait(req, model)
        except ApiError as e:
            return error_response(e)
        if call.stream:
            return EventStream(lambda write: self._stream_completion(write, call, req, model), "text/event-stream")
        return await self._answer(request, lambda: self._completion(call, req, model))

    def _prompt_text(self, call: CompletionCall, req: HeadRequest, model: ModelInfo) -> str:
        if call.prompt_text is not None:
            return call.prompt_text
        return model.tokenizer.decode(req.prompt_ids, skip_special=False)

    async def _completion(self, call: CompletionCall, req: HeadRequest, model: ModelInfo) -> dict[str, Any]:
        prompt_text = self._prompt_text(call, req, model)
        logprobs = self._legacy_logprobs(call, model, prompt_text)
        parts = [prompt_text] if call.echo else []
        finish = "length"
        async with self.head.open(req) as handle:
            async for ev in handle:
                if isinstance(ev, Failed):
                    raise api_error(ev)
                if isinstance(ev, PromptScores) and logprobs is not None:
                    logprobs.add_prompt(req.prompt_ids, ev)
                elif isinstance(ev, TokenOut):
                    parts.append(ev.text)
                    if logprobs is not None:
                        logprobs.add_token(ev)
                elif isinstance(ev, Finished):
                    parts.append(ev.text)
                    finish = ev.reason
                    await self.head.trace(handle)
        return completion_body(new_id("cmpl"), call.model, "".join(parts), finish, handle.usage(),
                               logprobs.to_json() if logprobs is not None else None)

    @staticmethod
    def _legacy_logprobs(call: CompletionCall, model: ModelInfo, prompt_text: str) -> LegacyLogprobs | None:
        if call.logprobs is None:
            return None
        return LegacyLogprobs(model.tokenizer, call.logprobs, offset=0 if call.echo else len(prompt_text))

    async def _stream_completion(self, write: Write, call: CompletionCall, req: HeadRequest, model: ModelInfo) -> None:
        call_id, created = new_id("cmpl"), int(time.time())
        prompt_text = self._prompt_text(call, req, model)
        logprobs = self._legacy_logprobs(call, model, prompt_text)

        async def chunk(text: str, finish: str | None = None) -> None:
            lp = logprobs.take() if logprobs is not None else None
            await write(sse(completion_body(call_id, call.model, text, finish, None, lp, created=created)))

        try:
            async with self.head.open(req) as handle:
                if call.echo and logprobs is None:
                    await chunk(prompt_text)
                async for ev in handle:
                    if isinstance(ev, Failed):
                        raise api_error(ev)
                    if isinstance(ev, PromptScores):
                        if logprobs is not None:
                            logprobs.add_prompt(req.prompt_ids, ev)
                        await chunk(prompt_text)
                    elif isinstance(ev, TokenOut):
                        if logprobs is not None:
                            logprobs.add_token(ev)
                        if ev.text or logprobs is not None:
                            await chunk(ev.text)
                    elif isinstance(ev, Finished):
                        await chunk(ev.text, ev.reason)
                        await self.head.trace(handle)
            if call.include_usage:
                await write(sse(usage_chunk(call_id, call.model, created, handle.usage(), chat=False)))
            await write(sse("[DONE]"))
        except (ApiError, HeadError) as e:
            err = e if isinstance(e, ApiError) else api_error(e)
            await write(sse(err.body()))

    # --- chat ---------------------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        try:
            model = await self.head.model()
            call = parse_chat(await _json(request), model.name)
            ids = tuple(model.tokenizer.encode(render_chat(model, call.messages)))
            req = call.head_request(ids, model.max_context, trace=traced(request))
            await self._check_and_wait(req, model)
        except ApiError as e:
            return error_response(e)
        if call.stream:
            return EventStream(lambda write: self._stream_chat(write, call, req, model), "text/event-stream")
        return await self._answer(request, lambda: self._chat(call, req, model))

    async def _chat(self, call: ChatCall, req: HeadRequest, model: ModelInfo) -> dict[str, Any]:
        parts: list[str] = []
        entries: list[dict[str, Any]] | None = [] if call.logprobs else None
        finish = "length"
        async with self.head.open(req) as handle:
            async for ev in handle:
                if isinstance(ev, Failed):
                    raise api_error(ev)
                if isinstance(ev, TokenOut):
                    parts.append(ev.text)
                    if entries is not None:
                        entries.append(chat_logprob_entry(model.tokenizer, ev, call.top_logprobs))
                elif isinstance(ev, Finished):
                    parts.append(ev.text)
                    finish = ev.reason
                    await self.head.trace(handle)
        return chat_body(new_id("chatcmpl"), call.model, "".join(parts), finish, handle.usage(), entries)

    async def _stream_chat(self, write: Write, call: ChatCall, req: HeadRequest, model: ModelInfo) -> None:
        call_id, created = new_id("chatcmpl"), int(time.time())
        try:
            async with self.head.open(req) as handle:
                await write(sse(chat_chunk(call_id, call.model, created, {"role": "assistant", "content": ""})))
                async for ev in handle:
                    if isinstance(ev, Failed):
                        raise api_error(ev)
                    if isinstance(ev, TokenOut):
                        entries = [chat_logprob_entry(model.tokenizer, ev, call.top_logprobs)] if call.logprobs else None
                        if ev.text or entries:
                            await write(sse(chat_chunk(call_id, call.model, created, {"content": ev.text},
                                                       logprobs=entries)))
                    elif isinstance(ev, Finished):
                        if ev.text:
                            await write(sse(chat_chunk(call_id, call.model, created, {"content": ev.text})))
                        await write(sse(chat_chunk(call_id, call.model, created, {}, ev.reason)))
                        await self.head.trace(handle)
            if call.include_usage:
                await write(sse(usage_chunk(call_id, call.model, created, handle.usage(), chat=True)))
            await write(sse("[DONE]"))
        except (ApiError, HeadError) as e:
            err = e if isinstance(e, ApiError) else api_error(e)
            await write(sse(err.body()))

    # --- shared ---------------------------------------------------------------------------------------------

    async def _check_and_wait(self, req: HeadRequest, model: ModelInfo) -> None:
        try:
            check_request(req, model)
            await self.head.wait_ready()
        except HeadError as e:
            raise api_error(e) from None

    async def _answer(self, request: Request, work: Callable[[], Awaitable[dict[str, Any]]]) -> Response:
        try:
            body = await until_disconnect(request, work)
        except ApiError as e:
            return error_response(e)
        except HeadError as e:
            return error_response(api_error(e))
        if body is None:  # the client went away; the request was cancelled
            return Response(status_code=499)
        return JSONResponse(body)


def traced(request: Request) -> bool:
    """Whether the client asked for a trace of this request (`X-Swarmd-Trace: 1`)."""
    return request.headers.get("x-swarmd-trace", "").strip().lower() in ("1", "true", "yes")


def guarded(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """An unexpected failure still answers in OpenAI's error shape (a 500), and is logged with its traceback."""

    async def endpoint(request: Request) -> Response:
        try:
            return await route(request)
        except Exception as e:
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal"))

    return endpoint


async def _json(request: Request) -> Any:
    try:
        return await read_json(request)
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_json") from None


def render_chat(model: ModelInfo, messages: list[dict[str, Any]]) -> str:
    from models.text.chat import ChatTemplate, ChatTemplateError

    try:
        return ChatTemplate.for_tokenizer(model.tokenizer).render(messages)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), code="invalid_messages", param="messages") from None
