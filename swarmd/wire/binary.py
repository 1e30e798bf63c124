"""Fixed binary layouts of the messages on a token's critical path, inside the one framing.

A frame body is either a CBOR envelope (`swarmd.wire.messages`), whose first byte is a CBOR map's (0xA4), or
one of these layouts, whose first byte is a kind below 0x20 (a CBOR small integer, never an envelope):

    kind u8 | version u8 | seq u64 | fields                                     (little-endian throughout)
    ack            -
    forward        request_id str | head str | step u64 | hop u32 | start_pos u64 | epoch u64 | tensor
                   (a decode or plain prefill step: no sampling settings, targets, log-probs, resume or
                   speculative draft; a Forward with any of those travels as CBOR)
    token          request_id str | step u64 | token u64 | hop u32 | finish u8 | logprob f64 (NaN: none) |
                   k u16 | top_ids i64[k] | top_logprobs f64[k]
    expert_batch   batch_id str | step u64 | block u32 | hidden tensor | expert_ids tensor | gates tensor |
                   n u16 | n x (traced str | traced_step u64)
    expert_result  batch_id str | step u64 | block u32 | hidden tensor

    str     len u16 | UTF-8 bytes
    tensor  dtype u8 | ndim u8 | ndim x u32 | the raw little-endian bytes, exactly shape x itemsize

Decoding is as strict as the CBOR path: known kind and version, every length inside the body and no byte
left over, valid UTF-8, known dtypes, byte counts that match the shape, integers in range, and then the
message's own `check()` (shapes, dtypes, request ids). A tensor's bytes are not copied: the message holds a
view of the frame body, from which the stage copies the rows into its input buffer. What fails is a
`WireError`, as for a CBOR frame.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from swarmd.net.framing import HEADER
from swarmd.wire.codec import DTYPES, MAX_NDIM, WireError, WireTensor
from swarmd.wire.messages import (
    MAX_INT,
    MAX_STR,
    Ack,
    Envelope,
    ExpertBatch,
    ExpertResult,
    Forward,
    Message,
    Token,
    decode,
    encode,
)

VERSION = 1
ACK, FORWARD, TOKEN, EXPERT_BATCH, EXPERT_RESULT = 1, 2, 3, 4, 5
_HEAD = struct.Struct("<BBQ")
_FORWARD = struct.Struct("<QIQQ")  # step, hop, start_pos, epoch
_TOKEN = struct.Struct("<QQIBdH")  # step, token, hop, finish, logprob, k
_EXPERT = struct.Struct("<QI")  # step, block
_STR = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_TENSOR = struct.Struct("<BB")
_SHAPES = [struct.Struct(f"<{n}I") for n in range(MAX_NDIM + 1)]
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(sorted(DTYPES))}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}
_FINISH = ("", "stop", "length")
_ACK_FRAMES: dict[int, bytes] = {}


def is_binary(body: bytes | memoryview) -> bool:
    return bool(body) and body[0] < 0x20


def encode_frame(msg: Message, seq: int) -> bytes:
    """The length-prefixed frame of `msg`: its binary layout where it has one, else its CBOR envelope."""
    body = encode_body(msg, seq)
    return encode(msg, seq) if body is None else HEADER.pack(len(body)) + body


def ack_frame(seq: int) -> bytes:
    return HEADER.pack(_HEAD.size) + _HEAD.pack(ACK, VERSION, seq)


def encode_body(msg: Message, seq: int) -> bytes | None:
    """`msg` in its binary layout (checked as `encode` checks it), or None when it has none."""
    if isinstance(msg, Forward):
        if (msg.sampling is not None or msg.targets is not None or msg.all_logits or msg.resume_of
                or msg.draft is not None or msg.chain):
            return None
        tensor = msg.tokens if msg.tokens is not None else msg.hidden
        assert tensor is not None
        parts = [_HEAD.pack(FORWARD, VERSION, seq), _str(msg.request_id), _str(msg.head),
                 _FORWARD.pack(msg.step, msg.hop, msg.start_pos, msg.epoch), *_tensor(tensor)]
    elif isinstance(msg, Token):
        k = len(msg.top_ids)
        parts = [_HEAD.pack(TOKEN, VERSION, seq), _str(msg.request_id),
                 _TOKEN.pack(msg.step, msg.token, msg.hop, _FINISH.index(msg.finish),
                             math.nan if msg.logprob is None else msg.logprob, k),
                 struct.pack(f"<{k}q{k}d", *msg.top_ids, *msg.top_logprobs)]
    elif isinstance(msg, ExpertBatch):
        parts = [_HEAD.pack(EXPERT_BATCH, VERSION, seq), _str(msg.batch_id), _EXPERT.pack(msg.step, msg.block),
                 *_tensor(msg.hidden), *_tensor(msg.expert_ids), *_tensor(msg.gates), _STR.pack(len(msg.traced))]
        for rid, step in zip(msg.traced, msg.traced_steps, strict=True):
            parts += [_str(rid), _U64.pack(step)]
    elif isinstance(msg, ExpertResult):
        parts = [_HEAD.pack(EXPERT_RESULT, VERSION, seq), _str(msg.batch_id), _EXPERT.pack(msg.step, msg.block),
                 *_tensor(msg.hidden)]
    elif isinstance(msg, Ack):
        return _HEAD.pack(ACK, VERSION, seq)
    else:
        return None
    try:
        msg.check()
    except WireError as e:
        from swarmd.errors import LocalProtocolError

        raise LocalProtocolError(f"refusing to send an invalid {msg.TAG}: {e}") from e
    return b"".join(parts)


def decode_body(body: bytes) -> Envelope:
    """One frame body, binary or CBOR, decoded and checked; WireError if it is not a valid message."""
    if not is_binary(body):
        return decode(body)
    r = _Reader(memoryview(body))
    kind, version, seq = r.unpack(_HEAD)
    if kind not in (ACK, FORWARD, TOKEN, EXPERT_BATCH, EXPERT_RESULT):
        raise WireError("unknown_type", f"unknown binary message kind {kind}", seq=seq)
    if version != VERSION:
        raise WireError("bad_version", f"binary layout version {version} is not supported (we speak {VERSION})",
                        seq=seq)
    if seq > MAX_INT:
        raise WireError("bad_envelope", "seq must be a non-negative 64-bit integer")
    rid = ""
    try:
        msg: Message
        if kind == ACK:
            msg = Ack()
        elif kind == FORWARD:
            rid = r.str("request_id")
            head = r.str("head")
            step, hop, start_pos, epoch = r.unpack(_FORWARD)
            tensor = r.tensor("tensor")
            tokens, hidden = (tensor, None) if tensor.dtype in ("int32", "int64") else (None, tensor)
            msg = Forward(rid, _i(step), hop, _i(start_pos), head, tokens=tokens, hidden=hidden, epoch=_i(epoch))
        elif kind == TOKEN:
            rid = r.str("request_id")
            step, token, hop, finish, logprob, k = r.unpack(_TOKEN)
            if finish >= len(_FINISH):
                raise WireError("bad_field", f"token finish code {finish} is not known")
            top = r.unpack(struct.Struct(f"<{k}q{k}d"))
            msg = Token(rid, _i(step), _i(token), None if math.isnan(logprob) else logprob, tuple(top[:k]),
                        tuple(top[k:]), hop=hop, finish=_FINISH[finish])
        elif kind == EXPERT_BATCH:
            rid = r.str("batch_id")
            step, block = r.unpack(_EXPERT)
            hidden, ids, gates = r.tensor("hidden"), r.tensor("expert_ids"), r.tensor("gates")
            (n,) = r.unpack(_STR)
            traced, steps = [], []
            for _ in range(n):
                traced.append(r.str("traced"))
                steps.append(_i(r.unpack(_U64)[0]))
            msg = ExpertBatch(rid, _i(step), block, hidden, ids, gates, traced=tuple(traced), traced_steps=tuple(steps))
        else:
            rid = r.str("batch_id")
            step, block = r.unpack(_EXPERT)
            msg = ExpertResult(rid, _i(step), block, r.tensor("hidden"))
        r.end()
        msg.check()
    except WireError as e:
        e.seq, e.request_id = seq, e.request_id or rid[:MAX_STR]
        raise
    return Envelope(seq, msg)


# --- pieces -------------------------------------------------------------------------------------------------


def _str(text: str) -> bytes:
    data = text.encode()
    return _STR.pack(len(data)) + data


def _tensor(t: WireTensor) -> list[Any]:
    return [tensor_header(t.dtype, t.shape), t.data]


def tensor_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """A tensor's bytes before its data: dtype, ndim and shape."""
    return _TENSOR.pack(_DTYPE_CODES[dtype], len(shape)) + _SHAPES[len(shape)].pack(*shape)


def _i(value: int) -> int:
    if value > MAX_INT:
        raise WireError("bad_field", "an integer field must fit 63 bits")
    return value


class _Reader:
    """Reads a body front to back; every read is checked against what is left."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.at, self.size = view, 0, len(view)

    def _advance(self, n: int, what: str) -> int:
        """Where the next `n` bytes start; they are then read."""
        at = self.at
        if n > self.size - at:
            raise WireError("bad_field", f"{what} runs past the end of the frame")
        self.at = at + n
        return at

    def take(self, n: int, what: str) -> memoryview:
        at = self._advance(n, what)
        return self.view[at:at + n]

    def unpack(self, layout: struct.Struct) -> tuple[Any, ...]:
        return layout.unpack_from(self.view, self._advance(layout.size, "a field"))

    def str(self, what: str) -> str:
        (n,) = self.unpack(_STR)
        if n > MAX_STR:
            raise WireError("bad_field", f"{what} is longer than {MAX_STR} bytes")
        try:
            return str(self.take(n, what), "utf-8")
        except UnicodeDecodeError:
            raise WireError("bad_field", f"{what} is not UTF-8") from None

    def tensor(self, what: str) -> WireTensor:
        code, ndim = self.unpack(_TENSOR)
        dtype = _DTYPE_NAMES.get(code)
        if dtype is None:
            raise WireError("bad_tensor", f"{what} has unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise WireError("bad_tensor", f"{what} has {ndim} dimensions, at most {MAX_NDIM}")
        shape = self.unpack(_SHAPES[ndim])
        n = math.prod(shape) * DTYPES[dtype].itemsize
        if n > self.size - self.at:
            raise WireError("bad_tensor", f"{what} {dtype}{list(shape)} needs {n} bytes, the frame has fewer")
        return WireTensor(dtype, tuple(shape), self.take(n, what))  # type: ignore[arg-type]  # a view: no copy

    def end(self) -> None:
        if self.at != self.size:
            raise WireError("bad_envelope", f"{self.size - self.at} bytes after the message")
