"""OpenAI's request and response shapes: JSON in -> `HeadRequest`, head events -> JSON out. No I/O, but not pure:
a response's id is random (`new_id`) and its `created` time is now unless given.

Covers `/v1/completions` (prompt as text or token ids, `echo`, `logprobs` in the legacy shape: `tokens`,
`token_logprobs`, `top_logprobs` keyed by decoded token text, `text_offset`) and `/v1/chat/completions`
(`logprobs` / `top_logprobs` in the chat shape), streamed or not, and OpenAI's error shape. The routes in
`swarmd.api.openai_routes` do the I/O.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarmd.inference.head.service import HeadRequest
from swarmd.inference.head.session import PromptScores, TokenOut
from swarmd.spec_settings import SpecError, SpecRequest, parse_spec_field

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint
MAX_STOPS = 16


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after  # s: the `Retry-After` header of a 429

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 503:
            kind = "service_unavailable"
        elif self.status == 429:
            kind = "requests"  # OpenAI's type for a rate limit; its clients retry after `Retry-After`
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# --- request fields -------------------------------------------------------------------------------------------


def number_field(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be a number from {lo:g} to {hi:g}", code="invalid_value", param=name)
    return float(value)


def integer_field(body: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be an integer from {lo} to {hi}", code="invalid_value", param=name)
    return value


def flag_field(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false", code="invalid_type", param=name)
    return value


def stop_field(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} of them",
                       code="invalid_value", param="stop")
    return tuple(stops)


def _unsupported(body: Mapping[str, Any]) -> None:
    """Refuse what would silently change the output if ignored."""
    if integer_field(body, "n", 1, 1, 1) != 1 or integer_field(body, "best_of", 1, 1, 1) != 1:
        raise ApiError(400, "only n = 1 is supported", code="unsupported_value", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if number_field(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise ApiError(400, f"'{name}' is not supported (leave it 0)", code="unsupported_parameter", param=name)
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported", code="unsupported_parameter", param="logit_bias")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported", code="unsupported_parameter", param="suffix")


def check_model(body: Mapping[str, Any], served: str) -> str:
    model = body.get("model")
    if model is None:
        return served
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", code="invalid_type", param="model")
    if model != served:
        raise ApiError(404, f"The model '{model}' does not exist: this swarm serves '{served}' (see /v1/models)",
                       code="model_not_found", param="model")
    return model


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    top_k = integer_field(body, "top_k", 0, -1, 1 << 20)
    return {
        "temperature": number_field(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": number_field(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        "top_k": max(top_k or 0, 0),  # -1 means "off", as in vLLM
        "seed": integer_field(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        "stop": stop_field(body),
    }


def speculate_field(body: Mapping[str, Any]) -> SpecRequest | None:
    """The extension field `speculate`: {"mode": "off" | "ngram" | "model:NAME", "draft_tokens": K}."""
    try:
        return parse_spec_field(body.get("speculate"))
    except SpecError as e:
        raise ApiError(400, str(e), code="invalid_value", param="speculate") from None


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = flag_field(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", code="invalid_type", param="stream_options")
    return stream, bool(options.get("include_usage")) and stream


@dataclass(frozen=True)
class CompletionCall:
    """A parsed `/v1/completions` body (the prompt still to be tokenized when it is text)."""

    model: str
    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    max_tokens: int
    sampling: dict[str, Any]
    logprobs: int | None  # None: no log-probs
    echo: bool
    stream: bool
    include_usage: bool
    speculate: SpecRequest | None = None

    def head_request(self, prompt_ids: Sequence[int], trace: bool = False) -> HeadRequest:
        s = self.sampling
        return HeadRequest(tuple(prompt_ids), self.max_tokens, s["temperature"], s["top_p"], s["top_k"],
                           _seed(s["seed"]), s["stop"], logprobs=0 if self.logprobs is None else max(self.logprobs, 1),
                           prompt_scores=self.echo and self.logprobs is not None, trace=trace,
                           speculate=self.speculate)


def parse_completion(body: Any, served: str) -> CompletionCall:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = check_model(body, served)
    _unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    text, ids = None, None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = tuple(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "send one prompt per request (batches of prompts are not supported)",
                       code="unsupported_value", param="prompt")
    else:
        raise ApiError(400, "'prompt' must be a string or a list of token ids", code="invalid_type", param="prompt")
    stream, usage = _stream(body)
    max_tokens = integer_field(body, "max_tokens", COMPLETIONS_MAX_TOKENS, 0, 1 << 20)
    assert max_tokens is not None
    echo = flag_field(body, "echo")
    logprobs = integer_field(body, "logprobs", None, 0, 20)
    if max_tokens == 0 and not echo:
        raise ApiError(400, "'max_tokens' 0 is only useful with 'echo' (to score the prompt)", code="invalid_value",
                       param="max_tokens")
    return CompletionCall(model, text, ids, max_tokens, _sampling(body), logprobs, echo, stream, usage,
                          speculate_field(body))


@dataclass(frozen=True)
class ChatCall:
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None  # None: until the context is full
    sampling: dict[str, Any]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    speculate: SpecRequest | None = None

    def head_request(self, prompt_ids: Sequence[int], max_context: int, trace: bool = False) -> HeadRequest:
        s = self.sampling
        room = max(max_context - len(prompt_ids), 1)
        max_tokens = room if self.max_tokens is None else min(self.max_tokens, room)
        return HeadRequest(tuple(prompt_ids), max_tokens, s["temperature"], s["top_p"], s["top_k"],
                           _seed(s["seed"]), s["stop"], logprobs=max(self.top_logprobs, 1) if self.logprobs else 0,
                           trace=trace, speculate=self.speculate)


def parse_chat(body: Any, served: str) -> ChatCall:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = check_model(body, served)
    _unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", code="invalid_type",
                       param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text parts can be served
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        out.append({**m, "content": content})
    max_tokens = integer_field(body, "max_completion_tokens", None, 1, 1 << 20)
    if max_tokens is None:
        max_tokens = integer_field(body, "max_tokens", None, 1, 1 << 20)
    logprobs = flag_field(body, "logprobs")
    top = integer_field(body, "top_logprobs", 0, 0, 20) or 0
    if top and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", code="invalid_value", param="top_logprobs")
    stream, usage = _stream(body)
    return ChatCall(model, out, max_tokens, _sampling(body), logprobs, top, stream, usage, speculate_field(body))


def _seed(seed: int | None) -> int | None:
    return None if seed is None else seed & ((1 << 63) - 1)  # negative seeds map into the head's range


# --- responses ------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def models_list(name: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(name, created)]}


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "swarmd"}


@dataclass
class LegacyLogprobs:
    """The legacy completions `logprobs` object, built token by token."""

    tokenizer: Any
    k: int
    offset: int = 0  # characters of text before the next token
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special=False)

    def add(self, token_id: int, logprob: float | None, top: Sequence[tuple[int, float]] | None) -> None:
        text = self.piece(token_id)
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(None if top is None else {self.piece(i): lp for i, lp in list(top)[:self.k]})
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def add_prompt(self, prompt_ids: Sequence[int], scores: PromptScores) -> None:
        for i, token_id in enumerate(prompt_ids):
            if i == 0:
                self.add(token_id, None, None)
            else:
                self.add(token_id, scores.token_logprobs[i - 1], scores.top[i - 1])

    def add_token(self, event: TokenOut) -> None:
        self.add(event.token_id, event.logprob, event.top)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}

    def take(self) -> dict[str, Any]:
        """What was added since the last take (one streamed chunk's share)."""
        out = self.to_json()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def completion_body(call_id: str, model: str, text: str, finish: str | None, usage: dict[str, int] | None,
                    logprobs: dict[str, Any] | None, *, created: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": call_id, "object": "text_completion", "created": created or int(time.time()), "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def chat_logprob_entry(tokenizer: Any, event: TokenOut, k: int) -> dict[str, Any]:
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token_id, skip_special=False)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}

    item = entry(event.token_id, event.logprob if event.logprob is not None else 0.0)
    item["top_logprobs"] = [entry(i, lp) for i, lp in event.top[:k]]
    return item


def chat_body(call_id: str, model: str, text: str, finish: str, usage: dict[str, int],
              logprobs: list[dict[str, Any]] | None, *, created: int | None = None) -> dict[str, Any]:
    return {
        "id": call_id, "object": "chat.completion", "created": created or int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish}],
        "usage": usage,
    }


def chat_chunk(call_id: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "id": call_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta,
                     "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish}],
    }


def usage_chunk(call_id: str, model: str, created: int, usage: dict[str, int], *, chat: bool) -> dict[str, Any]:
    return {"id": call_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage}
