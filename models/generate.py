"""Single-process generation over a whole-model `StageModel`: the loop behind `swarmd run`, and the
baseline every distributed figure is compared with.

Yields text as it becomes final: a character split over tokens, or text that may be the start of a
stop string, is held back until it is decided. Stops on an end-of-generation token, a stop string,
`max_tokens`, or a full context.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from models.errors import ModelError
from models.sampling import SamplingParams, sample
from models.text.stop_text import StopText


class WholeModel(Protocol):
    """What generation needs from `models.stage.StageModel` (first and last stage at once)."""

    max_context: int

    def add_request(self, request_id: str) -> None: ...
    def free_request(self, request_id: str) -> None: ...
    def forward(self, items: Sequence[Any]) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class GeneratedText:
    """One step of output. `token_id` is None for the last, held-back text released at the end."""

    token_id: int | None
    text: str  # may be "" while a character or a possible stop string is still held back
    logits: np.ndarray | None = None  # the logits the token was sampled from, when asked for


@dataclass
class GenerationStats:
    prompt_tokens: int
    completion_tokens: int = 0  # sampled tokens, the end-of-generation token included
    prefill_s: float = 0.0  # prompt forward + first sample: the time to the first token
    decode_s: float = 0.0  # every later token's forward + sample
    decode_steps: int = 0
    finish_reason: str = ""  # "stop" (end token or stop string) or "length" (max_tokens or full context)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class Generation:
    """Iterate to generate; `stats` fills in as it goes and is complete when iteration ends."""

    model: WholeModel
    tokenizer: Any  # models.text.tokenizer.Tokenizer
    prompt_ids: Sequence[int]
    params: SamplingParams
    seed: int | None = None
    keep_logits: bool = False
    request_id: str = field(default_factory=lambda: f"gen-{uuid.uuid4().hex[:12]}")
    stats: GenerationStats = field(init=False)
    token_ids: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_ids = [int(i) for i in self.prompt_ids]
        check_prompt_fits(len(self.prompt_ids), self.model.max_context)
        if self.seed is None:
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))

    def __iter__(self) -> Iterator[GeneratedText]:
        from models.stage import StageInput

        assert self.seed is not None
        tok, params, stats = self.tokenizer, self.params, self.stats
        stream, stops = tok.stream_decoder(), StopText(params.stop)
        self.model.add_request(self.request_id)
        try:
            start = time.perf_counter()
            data = np.asarray(self.prompt_ids, dtype=np.int32)
            logits = self.model.forward([StageInput(self.request_id, 0, data)])[0]
            position = len(self.prompt_ids)
            for step in range(params.max_tokens):
                token = sample(logits, params, seed=self.seed, step=step)
                now = time.perf_counter()
                if step == 0:
                    stats.prefill_s = now - start
                else:
                    stats.decode_s += now - start
                    stats.decode_steps += 1
                stats.completion_tokens += 1
                if tok.is_stop(token):
                    stats.finish_reason = "stop"
                    break
                self.token_ids.append(token)
                text, stopped = stops.push(stream.feed(token))
                yield GeneratedText(token, text, logits if self.keep_logits else None)
                if stopped:
                    stats.finish_reason = "stop"
                    return
                if step + 1 == params.max_tokens or position >= self.model.max_context:
                    stats.finish_reason = "length"
                    break
                start = time.perf_counter()
                logits = self.model.forward([StageInput(self.request_id, position,
                                                        np.asarray([token], dtype=np.int32))])[0]
                position += 1
            rest, _ = stops.push(stream.flush())
            rest += stops.flush()
            if rest:
                yield GeneratedText(None, rest)
        finally:
            self.model.free_request(self.request_id)


def check_prompt_fits(n_prompt: int, max_context: int) -> None:
    """A prompt must be non-empty and leave room for at least one generated token."""
    if n_prompt == 0:
        raise ModelError("the prompt is empty: give some text to continue")
    if n_prompt >= max_context:
        raise ModelError(f"the prompt is {n_prompt} tokens but the context holds {max_context}: "
                         "shorten the prompt or raise --max-context (up to the model's context length)")


def generate(model: WholeModel, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams, *,
             seed: int | None = None, keep_logits: bool = False) -> Generation:
    """Start generating a completion of `prompt_ids`; iterate the result for its text."""
    return Generation(model, tokenizer, prompt_ids, params, seed=seed, keep_logits=keep_logits)
