"""The frames of a running request's decode steps, known byte for byte but for their seq and free bytes. Sans-IO.

A request's decode steps cross each hop as frames of one layout (`swarmd.wire.binary`): the next `Forward` on a
link differs from the last only in its seq, step, position and the tensor's bytes; the next `Token` only in
its seq, step and token. So:
- reading: once a frame was decoded and checked whole, the one after it is recognised by comparing bytes
  (`Follower.seq`). A body equal to the expected frame but in its seq and free bytes carries the same request,
  head, hop, epoch, dtype and shape, which passed every check before, and the step and position that come next.
  Anything else does not match, and is decoded whole.
- writing: a message that `describes` says fits the layout is framed by joining the bytes laid out once
  (`Follower.frame`), as `encode_frame` would frame it.

    NextForward  a one-row Forward; free: the tensor's bytes (hidden states, or one token id)
    NextToken    a Token with no log-probs and no finish; free: the token (u64)
"""

from __future__ import annotations

import copy
import math
import struct
from dataclasses import dataclass

from swarmd.net.framing import HEADER
from swarmd.wire.binary import (
    _FORWARD,
    _HEAD,
    _U64,
    FORWARD,
    TOKEN,
    VERSION,
    _str,
    encode_body,
    tensor_header,
)
from swarmd.wire.codec import DTYPES
from swarmd.wire.messages import Forward, Message, Token

_SEQ_AT = 2  # kind u8 | version u8 | seq u64
_FIELDS_AT = _HEAD.size
_AFTER_TOKEN = struct.Struct("<IBdH")  # hop, finish, logprob, k: a token frame's fields after its token


@dataclass(frozen=True)
class NextForward:
    """The binary frame of a one-row `Forward` of step `step` at `start_pos`."""

    request_id: str
    head: str
    step: int
    hop: int
    start_pos: int
    epoch: int
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, msg: Forward) -> NextForward | None:
        """`msg`'s own frame, if it is a one-row step in the binary layout."""
        t = msg.hidden if msg.hidden is not None else msg.tokens
        if t is None or msg.rows != 1 or encode_body(msg, 0) is None:  # (None: a field the layout has not)
            return None
        return cls(msg.request_id, msg.head, msg.step, msg.hop, msg.start_pos, msg.epoch, t.dtype, t.shape)

    def then(self) -> NextForward:
        return NextForward(self.request_id, self.head, self.step + 1, self.hop, self.start_pos + 1, self.epoch,
                           self.dtype, self.shape)

    def describes(self, msg: Message) -> bool:
        """Whether `msg` is framed as this frame is (but for its tensor's bytes)."""
        if type(msg) is not Forward:
            return False
        t = msg.hidden if msg.tokens is None else msg.tokens
        return (t is not None and msg.step == self.step and msg.start_pos == self.start_pos and msg.hop == self.hop
                and msg.epoch == self.epoch and msg.request_id == self.request_id and msg.head == self.head
                and t.dtype == self.dtype and t.shape == self.shape and (msg.tokens is None) == (self.hop != 0)
                and msg.sampling is None and msg.targets is None and not msg.all_logits and not msg.resume_of
                and msg.draft is None and not msg.chain)


@dataclass(frozen=True)
class NextToken:
    """The binary frame of a `Token` of step `step` with no log-probs and no finish."""

    request_id: str
    step: int
    hop: int

    @classmethod
    def of(cls, msg: Token) -> NextToken | None:
        if msg.logprob is not None or msg.top_ids or msg.finish:
            return None
        return cls(msg.request_id, msg.step, msg.hop)

    def then(self) -> NextToken:
        return NextToken(self.request_id, self.step + 1, self.hop)

    def describes(self, msg: Message) -> bool:
        return (type(msg) is Token and msg.step == self.step and msg.hop == self.hop
                and msg.request_id == self.request_id and msg.logprob is None and not msg.top_ids and not msg.finish)


class Follower:
    """One expected frame (`NextForward` or `NextToken`), its bytes laid out once: to match bodies read, or to
    frame a message it `describes`."""

    def __init__(self, expected: NextForward | NextToken) -> None:
        self.expected = expected
        if isinstance(expected, NextForward):
            self._kind = bytes((FORWARD, VERSION))
            self._ids = _str(expected.request_id) + _str(expected.head)
            self._tensor = tensor_header(expected.dtype, expected.shape)
            self._after = b""
            self.free = math.prod(expected.shape) * DTYPES[expected.dtype].itemsize
        else:
            self._kind = bytes((TOKEN, VERSION))
            self._ids = _str(expected.request_id)
            self._after = _AFTER_TOKEN.pack(expected.hop, 0, math.nan, 0)
            self.free = _U64.size
        self._before = self._fields()
        self._lo = _FIELDS_AT + len(self._before)
        self._hi = self._lo + self.free
        self.size = self._hi + len(self._after)

    def _fields(self) -> bytes:
        """The bytes after the seq up to the free ones."""
        e = self.expected
        if isinstance(e, NextForward):
            return b"".join((self._ids, _FORWARD.pack(e.step, e.hop, e.start_pos, e.epoch), self._tensor))
        return self._ids + _U64.pack(e.step)

    def then(self) -> Follower:
        """The frame after this one (the step after; its sizes and the rest of its bytes the same)."""
        nxt = copy.copy(self)
        nxt.expected = self.expected.then()
        nxt._before = nxt._fields()
        return nxt

    # --- reading ---------------------------------------------------------------------------------------------

    def seq(self, body: bytes) -> int | None:
        """The seq of `body` if it is the expected frame, else None."""
        if (len(body) != self.size or body[:_SEQ_AT] != self._kind or body[_FIELDS_AT:self._lo] != self._before
                or body[self._hi:] != self._after):
            return None
        return _U64.unpack_from(body, _SEQ_AT)[0]

    def free_bytes(self, body: bytes) -> memoryview:
        return memoryview(body)[self._lo:self._hi]

    def token(self, body: bytes) -> int:
        """A `NextToken` frame's token."""
        return _U64.unpack_from(body, self._lo)[0]

    # --- writing ---------------------------------------------------------------------------------------------

    def frame(self, seq: int, msg: Forward | Token) -> bytes:
        """The length-prefixed frame of `msg`, which this layout `describes`, numbered `seq`."""
        return self.frame_free(seq, free_of(msg))

    def frame_free(self, seq: int, free: bytes | memoryview) -> bytes:
        """The frame numbered `seq` whose free bytes are `free` (`free_of` the message it is)."""
        return b"".join((HEADER.pack(self.size), self._kind, _U64.pack(seq), self._before, free, self._after))


def free_of(msg: Forward | Token) -> bytes | memoryview:
    """The bytes of `msg` that a layout leaves free: a Token's token, a Forward's tensor."""
    if type(msg) is Token:
        return token_free(msg.token)
    t = msg.hidden if msg.tokens is None else msg.tokens
    assert t is not None
    return t.data


def token_free(token: int) -> bytes:
    """A `NextToken` frame's free bytes: the token (u64)."""
    return _U64.pack(token)
