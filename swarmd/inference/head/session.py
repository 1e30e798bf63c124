"""One request as its head sees it: tokens in (in any order, repeated), text and a finish out. Sans-IO.

The last stage sends each sampled token to the head as a `Token` (and, for teacher forcing, the prompt's
log-probs as one `Logprobs`). `HeadSession` puts tokens back in step order, ignores repeats, turns them
into text as it becomes final (a character split over tokens, or the start of a possible stop string, is
held back), finds stop strings, and says when the request is over: `Finished` or `Failed`. The trio code in
`swarmd.inference.head.service` feeds it messages and timers and does what the events ask (stream, cancel the chain).

Its phase changes only through `SESSION_TRANSITIONS` (a pair not in it raises LocalProtocolError):
streaming --FINISH--> finished; streaming --FAIL--> failed; finished --FAIL--> failed (only while the prompt's
log-probs are still due: a request is not failed after it was wholly given out).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from models.text.stop_text import StopText
from swarmd.errors import LocalProtocolError
from swarmd.wire.messages import Error, Logprobs, Token


class TextDecoder(Protocol):
    """`models.text.tokenizer.StreamDecoder`: token ids to text, holding back incomplete characters."""

    def feed(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


@dataclass(frozen=True)
class TokenOut:
    """A generated token and the text it made final (often its own text; "" while something is held back)."""

    step: int
    token_id: int
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-prob), most likely first


@dataclass(frozen=True)
class PromptScores:
    """Teacher forcing: for prompt positions 1..n-1, the log-prob of the prompt's token and the top k there."""

    token_logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end token or stop string) or "length"
    text: str = ""  # text held back until the end


@dataclass(frozen=True)
class Failed:
    code: str
    message: str


Event = TokenOut | PromptScores | Finished | Failed


class SessionPhase(enum.Enum):
    STREAMING = "streaming"  # tokens come in and go out as text
    FINISHED = "finished"  # an end token, a stop string or the length ended it (`finish_reason`)
    FAILED = "failed"  # `error` says why


class SessionEvent(enum.Enum):
    FINISH = "finish"
    FAIL = "fail"


SESSION_TRANSITIONS: dict[tuple[SessionPhase, SessionEvent], SessionPhase] = {
    (SessionPhase.STREAMING, SessionEvent.FINISH): SessionPhase.FINISHED,
    (SessionPhase.STREAMING, SessionEvent.FAIL): SessionPhase.FAILED,
    (SessionPhase.FINISHED, SessionEvent.FAIL): SessionPhase.FAILED,
}


@dataclass
class HeadSession:
    request_id: str
    prompt_len: int
    max_tokens: int  # 0: score the prompt only (needs want_prompt_scores)
    decoder: TextDecoder
    stop_strings: Sequence[str] = ()
    want_prompt_scores: bool = False
    completion_tokens: int = 0  # sampled tokens, an end token included
    tokens: list[int] = field(default_factory=list)  # the request's generated token history, in step order
    finish_reason: str = ""
    error: Failed | None = None
    phase: SessionPhase = SessionPhase.STREAMING
    _next_step: int = 0
    _early: dict[int, Token] = field(default_factory=dict)
    _held: list[Event] = field(default_factory=list)  # tokens that came before the prompt scores
    _scored: bool = False
    _stops: StopText = field(init=False)

    def __post_init__(self) -> None:
        self._stops = StopText(tuple(self.stop_strings))

    @property
    def ended(self) -> bool:
        """No more tokens will be taken (finished or failed)."""
        return self.phase is not SessionPhase.STREAMING

    @property
    def scored(self) -> bool:
        """The prompt's log-probs (teacher forcing) came back."""
        return self._scored

    @property
    def done(self) -> bool:
        """Every event has been given out: ended, and the prompt scores are in if they were asked for."""
        return self.phase is SessionPhase.FAILED or (
            self.phase is SessionPhase.FINISHED and (self._scored or not self.want_prompt_scores))

    def on_token(self, msg: Token) -> list[Event]:
        if self.ended or self.max_tokens == 0 or msg.step < self._next_step or msg.step in self._early:
            return []  # a repeat, after the end, or the token a scoring-only request does not want
        if msg.step >= max(self.max_tokens, 1):
            return self.fail("bad_token", f"token for step {msg.step} of a request limited to {self.max_tokens}")
        self._early[msg.step] = msg
        out: list[Event] = []
        while not self.ended and self._next_step in self._early:
            out += self._take(self._early.pop(self._next_step))
            self._next_step += 1
        return self._release(out)

    def on_logprobs(self, msg: Logprobs) -> list[Event]:
        if self.error is not None or self._scored or not self.want_prompt_scores:
            return []
        self._scored = True
        ids, lps = msg.top_ids.to_array(), msg.top_logprobs.to_array()
        top = tuple(tuple((int(i), float(p)) for i, p in zip(ids[r], lps[r], strict=True)) for r in range(len(ids)))
        scores = PromptScores(tuple(float(x) for x in msg.token_logprobs.to_array()), top)
        out: list[Event] = [scores, *self._held]
        self._held = []
        if self.max_tokens == 0:
            out.append(self._end("length"))
        return out

    def on_error(self, msg: Error) -> list[Event]:
        return self.fail(msg.code, msg.message)

    def fail(self, code: str, message: str) -> list[Event]:
        if self.done:
            return []
        self._fire(SessionEvent.FAIL)
        self._held = []
        self.error = Failed(code, message)
        return [self.error]

    def _take(self, msg: Token) -> list[Event]:
        self.completion_tokens += 1
        self.tokens.append(msg.token)
        top = tuple(zip(msg.top_ids, msg.top_logprobs, strict=True))
        if msg.finish == "stop":  # an end-of-generation token: not part of the text
            return self._finish("stop")
        text, stopped = self._stops.push(self.decoder.feed(msg.token))
        out: list[Event] = [TokenOut(msg.step, msg.token, text, msg.logprob, top)]
        if stopped:
            return [*out, self._end("stop")]
        if msg.finish == "length":
            return out + self._finish("length")
        return out

    def _finish(self, reason: str) -> list[Event]:
        rest, _ = self._stops.push(self.decoder.flush())
        rest += self._stops.flush()
        return [self._end(reason, rest)]

    def _end(self, reason: str, text: str = "") -> Finished:
        self._fire(SessionEvent.FINISH)
        self.finish_reason = reason
        return Finished(reason, text)

    def _fire(self, event: SessionEvent) -> None:
        try:
            self.phase = SESSION_TRANSITIONS[(self.phase, event)]
        except KeyError:
            raise LocalProtocolError(f"request {self.request_id}: {event.value} while {self.phase.value}") from None

    def _release(self, events: list[Event]) -> list[Event]:
        """Tokens wait for the prompt scores when those were asked for (they come first in the output)."""
        if self.want_prompt_scores and not self._scored:
            self._held += events
            return [e for e in events if isinstance(e, Failed)]
        return events
