"""Wire messages: frozen dataclasses with a type tag and a version.

Every frame is one CBOR map, the envelope `{"t": tag, "v": version, "seq": n, "body": {fields}}`. Decoding
checks the tag (known), the version (the one we speak), the fields (no unknown, none missing, each of its
declared type and range) and every tensor (dtype, shape and byte count agree). What the *receiver* expects
beyond that — e.g. the hidden size of the Plan's model — is checked by an `Expect` function (see
`swarmd.wire.expect`).

Two groups share the envelope: actor messages (`Forward`, `Token`, ...), delivered to handlers exactly once
by their `key()`, and link control (`Ack`, `Ping`, `Hello`, ...), consumed by the transport itself. `Error`
is both: sent back on a link it rejects the frame whose `seq` it carries; sent as a message it tells an
actor that a request failed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from swarmd.errors import LocalProtocolError
from swarmd.net.framing import DEFAULT_MAX_FRAME, frame
from swarmd.wire.codec import (
    WireError,
    WireTensor,
    decode_cbor,
    encode_cbor,
)

MAX_STR = 1024
MAX_ITEMS = 4096
MAX_INT = (1 << 63) - 1

Key = tuple[str, str, int, int]


class Message:
    """Base of every wire message. Subclasses are frozen dataclasses registered with `@wire`."""

    __slots__ = ()
    TAG: ClassVar[str]
    VERSION: ClassVar[int]
    CONTROL: ClassVar[bool] = False

    def key(self) -> Key | None:
        """What the receiver de-duplicates on; None for link control."""
        return None

    def check(self) -> None:
        """Value checks beyond types; raises WireError."""


def request_id_of(msg: Message) -> str:
    """The request a message belongs to ('' for link control)."""
    return getattr(msg, "request_id", "")


M = TypeVar("M", bound=type[Message])
REGISTRY: dict[str, type[Message]] = {}
_Decoder = Callable[[Any, str], Any]
_FIELDS: dict[type, list[tuple[str, _Decoder, bool]]] = {}
_NAMES: dict[type, frozenset[str]] = {}  # field names per class: checked on every frame, so made once
_ENCODE_NAMES: dict[type, tuple[str, ...]] = {}  # the same, in order, for encoding (dataclasses.fields is slow)


def wire(tag: str, version: int = 1, *, control: bool = False) -> Callable[[M], M]:
    """Register a message class under `tag`; builds its field decoders once."""

    def register(cls: M) -> M:
        if tag in REGISTRY:
            raise LocalProtocolError(f"message tag {tag!r} registered twice")
        cls.TAG, cls.VERSION, cls.CONTROL = tag, version, control
        _FIELDS[cls] = _field_decoders(cls)
        REGISTRY[tag] = cls
        return cls

    return register


# --- field decoding from annotations ------------------------------------------------------------------------


def _field_decoders(cls: type) -> list[tuple[str, _Decoder, bool]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, _decoder_for(hints[f.name]), required))
    return out


def _decoder_for(tp: Any) -> _Decoder:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        dec = _decoder_for(inner)
        return lambda v, what: None if v is None else dec(v, what)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _decoder_for(args[0])

        def tuple_of(v: Any, what: str) -> tuple:
            if not isinstance(v, list) or len(v) > MAX_ITEMS:
                raise WireError("bad_field", f"{what} must be a list of at most {MAX_ITEMS} items")
            return tuple(item(x, what) for x in v)

        return tuple_of
    if tp is WireTensor:
        return WireTensor.from_cbor
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        nested: type = tp
        _FIELDS.setdefault(nested, _field_decoders(nested))
        return lambda v, what: _decode_fields(nested, v, what)
    simple = _SIMPLE.get(tp)
    if simple is None:
        raise LocalProtocolError(f"no wire decoder for field type {tp!r}")
    return simple


def _int(v: Any, what: str) -> int:
    if type(v) is not int or not -MAX_INT <= v <= MAX_INT:
        raise WireError("bad_field", f"{what} must be a 64-bit integer")
    return v


def _float(v: Any, what: str) -> float:
    if type(v) not in (int, float):
        raise WireError("bad_field", f"{what} must be a number")
    return float(v)


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise WireError("bad_field", f"{what} must be true or false")
    return v


def _str(v: Any, what: str) -> str:
    if type(v) is not str or len(v) > MAX_STR:
        raise WireError("bad_field", f"{what} must be a string of at most {MAX_STR} characters")
    return v


def _bytes(v: Any, what: str) -> bytes:
    if type(v) is not bytes:
        raise WireError("bad_field", f"{what} must be a byte string")
    return v


_SIMPLE: dict[Any, _Decoder] = {int: _int, float: _float, bool: _bool, str: _str, bytes: _bytes}


def _decode_fields(cls: type, body: Any, what: str) -> Any:
    if not isinstance(body, dict):
        raise WireError("bad_field", f"{what} must be a map")
    fields = _FIELDS[cls]
    known = _NAMES.get(cls)
    if known is None:
        known = _NAMES[cls] = frozenset(name for name, _, _ in fields)
    unknown = [k for k in body if k not in known]
    if unknown:
        raise WireError("unknown_field", f"{what} has unknown field(s) {sorted(map(str, unknown))}")
    kwargs = {}
    for name, dec, required in fields:
        if name in body:
            kwargs[name] = dec(body[name], f"{what}.{name}")
        elif required:
            raise WireError("missing_field", f"{what} lacks field {name!r}")
    return cls(**kwargs)


def _to_cbor(value: Any) -> Any:
    if isinstance(value, WireTensor):
        return value.to_cbor()
    names = _ENCODE_NAMES.get(type(value))
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _ENCODE_NAMES[type(value)] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        return {name: _to_cbor(getattr(value, name)) for name in names}
    if isinstance(value, tuple):
        return [_to_cbor(x) for x in value]
    return value


# --- envelope ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Envelope:
    """One decoded frame: the message and the sequence number the link gave it."""

    seq: int
    msg: Message


def encode(msg: Message, seq: int = 0, *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """The length-prefixed frame carrying `msg`."""
    try:
        msg.check()
    except WireError as e:
        raise LocalProtocolError(f"refusing to send an invalid {msg.TAG}: {e}") from e
    body = {"t": msg.TAG, "v": msg.VERSION, "seq": seq, "body": _to_cbor(msg)}
    try:
        return frame(encode_cbor(body), max_frame)
    except ValueError as e:
        raise LocalProtocolError(f"refusing to send {msg.TAG}: {e}") from None


def decode(body: bytes) -> Envelope:
    """Decode and validate one frame body (without its length prefix); raises WireError."""
    value = decode_cbor(body)
    if not isinstance(value, dict) or set(value) != {"t", "v", "seq", "body"}:
        raise WireError("bad_envelope", "a frame must be a map with exactly t, v, seq and body")
    tag, version, seq = value["t"], value["v"], value["seq"]
    if type(seq) is not int or not 0 <= seq <= MAX_INT:
        raise WireError("bad_envelope", "seq must be a non-negative 64-bit integer")
    cls = REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise WireError("unknown_type", f"unknown message type {str(tag)[:40]!r}", seq=seq)
    if type(version) is not int or version != cls.VERSION:
        raise WireError("bad_version", f"{tag} version {str(version)[:20]} is not supported (we speak {cls.VERSION})",
                        seq=seq)
    try:
        msg = _decode_fields(cls, value["body"], tag)
        msg.check()
    except WireError as e:
        e.seq = seq
        if not e.request_id and isinstance(value["body"], dict) and isinstance(value["body"].get("request_id"), str):
            e.request_id = value["body"]["request_id"][:MAX_STR]
        raise
    return Envelope(seq, msg)


# --- value checks used by the messages --------------------------------------------------------------------------


def _check_logprobs(values: tuple[float, ...]) -> None:
    """Log-probs are numbers or -inf; NaN (from a model gone wrong, or a damaged frame) is refused."""
    need(not any(math.isnan(v) for v in values), "log-probs must not be NaN")


def need(ok: bool, what: str, code: str = "bad_field") -> None:
    if not ok:
        raise WireError(code, what)


def _check_request(request_id: str, step: int, hop: int) -> None:
    need(0 < len(request_id) <= 128, "request_id must be 1 to 128 characters")
    need(step >= 0, "step must be >= 0")
    need(hop >= 0, "hop must be >= 0")


def _check_rows(t: WireTensor, what: str, *, ndim: int, dtypes: frozenset[str]) -> None:
    need(len(t.shape) == ndim, f"{what} must have {ndim} dimension(s), got shape {list(t.shape)}", "bad_shape")
    need(t.dtype in dtypes, f"{what} dtype {t.dtype} is not one of {sorted(dtypes)}", "bad_dtype")


_FLOATS = frozenset({"float32", "float16", "bfloat16"})
FINISH_REASONS = frozenset({"", "stop", "length"})
_INTS = frozenset({"int32", "int64"})


# --- actor messages ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the last stage picks a token (seeded per request and step, so a retried step gives the same one)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: int = 0  # how many top alternatives to return with each token (0: none)
    max_tokens: int = 0  # the last stage stops after this many tokens (0: when the context is full)
    stop_ids: tuple[int, ...] = ()  # tokens that end the generation (end of sequence / turn)
    trace: bool = False  # every node on the request's path records its spans (swarmd.observe.spans)
    speculative: bool = False  # the head drafts: the last stage sends each step's tokens to the head, not stage 0

    def check(self) -> None:
        need(math.isfinite(self.temperature) and self.temperature >= 0, "sampling.temperature must be >= 0")
        need(0 < self.top_p <= 1, "sampling.top_p must be in (0, 1]")
        need(self.top_k >= 0, "sampling.top_k must be >= 0")
        need(0 <= self.logprobs <= 20, "sampling.logprobs must be 0..20")
        need(self.max_tokens >= 0, "sampling.max_tokens must be >= 0")
        need(len(self.stop_ids) <= 64 and all(i >= 0 for i in self.stop_ids), "sampling.stop_ids: at most 64 ids >= 0")


@dataclass(frozen=True, slots=True)
class Draft:
    """The drafted tokens a verify step checks: the step's rows are the last accepted token, then these. The last
    stage accepts each that is the token the target draws at its step (`swarmd.inference.spec.acceptance`)."""

    tokens: WireTensor  # int32 [k]

    @property
    def k(self) -> int:
        return self.tokens.shape[0] if self.tokens.shape else 0

    def check(self) -> None:
        _check_rows(self.tokens, "draft.tokens", ndim=1, dtypes=_INTS)
        need(1 <= self.k <= MAX_DRAFT, f"a draft holds 1 to {MAX_DRAFT} tokens")


MAX_DRAFT = 64


@wire("forward")
@dataclass(frozen=True, slots=True)
class Forward(Message):
    """Work for stage `hop` on a request: token ids for stage 0, hidden states for the rest.

    `step` 0 is the prefill (rows = prompt positions from `start_pos`), step k the k-th decode step.
    The last stage samples with `sampling` and sends a `Token` to stage 0 and to `head` (a peer id).
    With `all_logits` (teacher forcing), `targets` are the next token of every row but the last (the prompt
    shifted by one): the last stage sends their log-probs to the head in a `Logprobs` message.
    A moved request's first Forward may name the attempt it continues (`resume_of`): a stage still holding
    that attempt's KV cache keeps it and computes only the positions it lacks (`swarmd.inference.head.hop_local`).
    """

    request_id: str
    step: int
    hop: int
    start_pos: int
    head: str
    tokens: WireTensor | None = None  # int32 [n]
    hidden: WireTensor | None = None  # [n, hidden_size], compute dtype unless a wire dtype is configured
    epoch: int = 0  # the Plan epoch the sender routed by
    all_logits: bool = False  # the last stage returns log-probs for every row (teacher forcing)
    sampling: Sampling | None = None
    targets: WireTensor | None = None  # int32 [rows - 1] with all_logits: the token each row predicts
    resume_of: str = ""  # the earlier attempt of this request whose KV caches the stages may keep
    draft: Draft | None = None  # a verify step: rows are the last accepted token and these drafts
    chain: bool = False  # a speculative request's head hands the loop back: the last stage sends on to stage 0

    def key(self) -> Key:
        return ("forward", self.request_id, self.step, self.hop)

    def check(self) -> None:
        _check_request(self.request_id, self.step, self.hop)
        need(self.start_pos >= 0, "start_pos must be >= 0")
        need((self.tokens is None) != (self.hidden is None), "forward carries exactly one of tokens, hidden")
        if self.tokens is not None:
            _check_rows(self.tokens, "tokens", ndim=1, dtypes=_INTS)
        if self.hidden is not None:
            _check_rows(self.hidden, "hidden", ndim=2, dtypes=_FLOATS)
        if self.sampling is not None:
            self.sampling.check()
        if self.targets is not None:
            _check_rows(self.targets, "targets", ndim=1, dtypes=_INTS)
            need(self.all_logits, "targets are sent only with all_logits")
            need(self.targets.shape[0] == max(self.rows - 1, 0), "targets must have one entry per row but the last",
                 "bad_shape")
        if self.resume_of:
            need(len(self.resume_of) <= 128 and self.resume_of != self.request_id,
                 "resume_of must name another attempt (1 to 128 characters)")
            need(self.sampling is not None and self.start_pos == 0 and not self.all_logits,
                 "resume_of goes only on a moved request's first step, from position 0, without all_logits")
        if self.draft is not None:
            self.draft.check()
            need(self.sampling is None and not self.all_logits and self.step > 0,
                 "a draft goes only on a later step of a running request, without all_logits")
            need(self.rows == self.draft.k + 1, "a verify step has one row more than its draft", "bad_shape")
        if self.chain:
            need(self.draft is None and self.sampling is None and self.step > 0,
                 "chain goes only on a later step without a draft")

    @property
    def rows(self) -> int:
        t = self.tokens if self.tokens is not None else self.hidden
        return t.shape[0] if t is not None else 0


@wire("token")
@dataclass(frozen=True, slots=True)
class Token(Message):
    """The token sampled at `step` (sent by the last stage to stage 0 and to the head).

    `finish` is set on the last token of a request: "stop" (an end-of-generation token, which is then not
    part of the text) or "length" (max_tokens, or the context is full). Only the head gets that copy.
    """

    request_id: str
    step: int
    token: int
    logprob: float | None = None
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    hop: int = 0  # which copy: 0 to stage 0, 1 to the head (each is its own delivery)
    finish: str = ""  # "", "stop" or "length"

    def key(self) -> Key:
        return ("token", self.request_id, self.step, self.hop)

    def check(self) -> None:
        _check_request(self.request_id, self.step, self.hop)
        need(self.token >= 0, "token must be >= 0")
        need(len(self.top_ids) == len(self.top_logprobs), "top_ids and top_logprobs differ in length")
        need(self.finish in FINISH_REASONS, f"finish must be one of {sorted(FINISH_REASONS)}")
        _check_logprobs(self.top_logprobs if self.logprob is None else (self.logprob, *self.top_logprobs))


@wire("verified")
@dataclass(frozen=True, slots=True)
class Verified(Message):
    """The last stage's answer to a speculative request's step (sent to the head, which drafts the next one): the
    tokens of steps `step`, `step + 1`, ...: the drafted tokens the target accepted, then its own next token.

    `drafted` is the number of tokens the step verified (0 for a step without a draft). With logprobs, each token's
    log-prob and its top alternatives (`top_ids` / `top_logprobs`: `len(tokens)` groups of the same size, flat).
    `finish` as on a `Token`: set when the last token ends the request."""

    request_id: str
    step: int
    tokens: tuple[int, ...]
    drafted: int = 0
    logprobs: tuple[float, ...] = ()
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    finish: str = ""
    hop: int = 1

    def key(self) -> Key:
        return ("verified", self.request_id, self.step, self.hop)

    def check(self) -> None:
        _check_request(self.request_id, self.step, self.hop)
        n = len(self.tokens)
        need(1 <= n <= self.drafted + 1 and all(t >= 0 for t in self.tokens),
             "verified carries 1 to drafted + 1 token ids >= 0")
        need(0 <= self.drafted <= MAX_DRAFT, f"drafted must be 0..{MAX_DRAFT}")
        need(len(self.logprobs) in (0, n), "logprobs: none or one per token")
        need(len(self.top_ids) == len(self.top_logprobs) and len(self.top_ids) % n == 0,
             "top_ids and top_logprobs: the same number of entries per token")
        need(self.finish in FINISH_REASONS, f"finish must be one of {sorted(FINISH_REASONS)}")
        _check_logprobs((*self.logprobs, *self.top_logprobs))

    def top(self, i: int) -> tuple[tuple[int, float], ...]:
        """Token i's top alternatives, (id, log-prob) pairs."""
        per = len(self.top_ids) // len(self.tokens)
        return tuple(zip(self.top_ids[i * per:(i + 1) * per], self.top_logprobs[i * per:(i + 1) * per], strict=True))


@wire("speculate")
@dataclass(frozen=True, slots=True)
class Speculate(Message):
    """The head of a speculative request takes the loop back from the chain: the last stage (`hop`) sends the
    request's next steps to the head (as `Verified`), which drafts them, instead of closing the loop at stage 0.
    `step` is the last token the head had when it asked."""

    request_id: str
    step: int
    hop: int

    def key(self) -> Key:
        return ("speculate", self.request_id, self.step, self.hop)

    def check(self) -> None:
        _check_request(self.request_id, self.step, self.hop)


@wire("logprobs")
@dataclass(frozen=True, slots=True)
class Logprobs(Message):
    """Per-row log-probs of a step run with all_logits: of the given next token and the top k alternatives."""

    request_id: str
    step: int
    token_logprobs: WireTensor  # float32 [n]
    top_ids: WireTensor  # int32 [n, k]
    top_logprobs: WireTensor  # float32 [n, k]
    hop: int = 0

    def key(self) -> Key:
        return ("logprobs", self.request_id, self.step, self.hop)

    def check(self) -> None:
        _check_request(self.request_id, self.step, self.hop)
        _check_rows(self.token_logprobs, "token_logprobs", ndim=1, dtypes=frozenset({"float32"}))
        _check_rows(self.top_ids, "top_ids", ndim=2, dtypes=_INTS)
        _check_rows(self.top_logprobs, "top_logprobs", ndim=2, dtypes=frozenset({"float32"}))
        n = self.token_logprobs.shape[0]
        need(self.top_ids.shape == self.top_logprobs.shape and self.top_ids.shape[0] == n,
             "logprobs tensors disagree on rows or k", "bad_shape")


@wire("cancel")
@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """The request is over (finished, cancelled, timed out): free its KV caches along the chain."""

    request_id: str
    reason: str = "finished"
    hop: int = 0

    def key(self) -> Key:
        return ("cancel", self.request_id, 0, self.hop)

    def check(self) -> None:
        _check_request(self.request_id, 0, self.hop)


@wire("error")
@dataclass(frozen=True, slots=True)
class Error(Message):
    """A failure. As a reply on a link: the frame `seq` was refused. As a message: a request failed."""

    code: str
    message: str
    request_id: str = ""
    step: int = 0
    hop: int = 0

    def key(self) -> Key | None:
        return ("error", self.request_id, self.step, self.hop) if self.request_id else None

    def check(self) -> None:
        need(0 < len(self.code) <= 64, "error code must be 1 to 64 characters")


@wire("expert_batch")
@dataclass(frozen=True, slots=True)
class ExpertBatch(Message):
    """Rows of one MoE block for the experts a node holds: row i goes to experts `expert_ids[i]` with `gates[i]`.

    Padding slots carry expert id -1. The reply is an `ExpertResult` with the gated sum per row.
    """

    batch_id: str
    step: int
    block: int
    hidden: WireTensor  # [m, hidden_size]
    expert_ids: WireTensor  # int32 [m, j]
    gates: WireTensor  # float32 [m, j]
    traced: tuple[str, ...] = ()  # traced requests among the rows: the expert records its spans under them
    traced_steps: tuple[int, ...] = ()  # their steps

    @property
    def request_id(self) -> str:
        return self.batch_id

    def key(self) -> Key:
        return ("expert_batch", self.batch_id, self.step, self.block)

    def check(self) -> None:
        _check_request(self.batch_id, self.step, self.block)
        _check_rows(self.hidden, "hidden", ndim=2, dtypes=_FLOATS)
        _check_rows(self.expert_ids, "expert_ids", ndim=2, dtypes=_INTS)
        _check_rows(self.gates, "gates", ndim=2, dtypes=frozenset({"float32"}))
        need(len(self.traced) == len(self.traced_steps) <= self.hidden.shape[0]
             and all(0 < len(r) <= 128 for r in self.traced) and all(s >= 0 for s in self.traced_steps),
             "traced: at most one request id (1 to 128 characters) per row, each with a step >= 0")
        need(self.expert_ids.shape == self.gates.shape and self.expert_ids.shape[0] == self.hidden.shape[0],
             "hidden, expert_ids and gates disagree on rows or slots", "bad_shape")


@wire("expert_result")
@dataclass(frozen=True, slots=True)
class ExpertResult(Message):
    """A node's expert outputs for an `ExpertBatch`: one row per selection it holds, in row-major order."""

    batch_id: str
    step: int
    block: int
    hidden: WireTensor  # [selections, hidden_size]

    @property
    def request_id(self) -> str:
        return self.batch_id

    def key(self) -> Key:
        return ("expert_result", self.batch_id, self.step, self.block)

    def check(self) -> None:
        _check_request(self.batch_id, self.step, self.block)
        _check_rows(self.hidden, "hidden", ndim=2, dtypes=_FLOATS)


@wire("trace_query")
@dataclass(frozen=True, slots=True)
class TraceQuery(Message):
    """The head asks stage `hop` for its spans of a traced request (answered with a `TraceSpans`)."""

    request_id: str
    hop: int = 0

    def key(self) -> Key:
        return ("trace_query", self.request_id, 0, self.hop)

    def check(self) -> None:
        _check_request(self.request_id, 0, self.hop)


@wire("trace_spans")
@dataclass(frozen=True, slots=True)
class TraceSpans(Message):
    """A node's spans of a request (CBOR, `swarmd.observe.spans.encode_spans`), on its clock; `received` and `answered`
    are its clock when the query came in and when this answer left (one more NTP-style clock sample)."""

    request_id: str
    spans: bytes
    received: float = 0.0
    answered: float = 0.0
    hop: int = 0

    def key(self) -> Key:
        return ("trace_spans", self.request_id, 0, self.hop)

    def check(self) -> None:
        _check_request(self.request_id, 0, self.hop)
        need(len(self.spans) <= 16 << 20, "spans must be at most 16 MiB")


# --- link control -----------------------------------------------------------------------------------------------


@wire("ack", control=True)
@dataclass(frozen=True, slots=True)
class Ack(Message):
    """The frame with the envelope's seq was accepted (a duplicate is accepted too)."""


@wire("ping", control=True)
@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Liveness probe; the envelope's seq is a nonce echoed by `Pong`."""


@wire("pong", control=True)
@dataclass(frozen=True, slots=True)
class Pong(Message):
    """Answer to `Ping`, sent by the receiver's reader at once, even while its handlers are busy."""


@wire("hello", control=True, version=2)
@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First frame each way on a new actor link: the sender's frame limit."""

    max_frame: int

    def check(self) -> None:
        need(self.max_frame > 0, "max_frame must be > 0")


ACTOR_MESSAGES: tuple[type[Message], ...] = tuple(c for c in REGISTRY.values() if not c.CONTROL)
