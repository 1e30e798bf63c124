"""A running request's next decode step, recognised from its frame's bytes on the lane's reader.

Once the stage ran a request's decode step on the hot lane (`StageActor.take_hot`), it knows the frame that
brings the next: the next `Forward` from the same previous stage or, on stage 0, the next `Token` from the
last stage, the same bytes but for the seq, the step, the position and the payload (`swarmd.wire.follow`).
`NextStep` is the stage's `swarmd.transport.lane.Shortcut`: the lane hands it such a frame undecoded, after
marking its key in the transport's de-duplication table, and it runs the step as `take_hot` would
(`StageActor.take_next`): the same book, batch and outputs. What the general path spends on a frame
whose every field but those was already checked (decoding, the plan's expectations, the generic admission)
is not spent again. Where the step's output down the chain follows the last frame sent there too (the next
stage's input, or on the last stage the token for stage 0), it is framed and written as soon as the model
ran and the book moved the request past it (`Ahead`), before the output messages and their checks, which
then must give that same message (`_then` checks it).

A step is expected only where the general hot path ran the one before it and would run this one the same way
(`expected_after`): one row, a stage with no MoE block, a request that is not speculative or traced, and on
stage 0 a token with no log-probs. Whatever does not match, or finds the stage in another state than the one
it left (`StageActor.take_next`), takes the general path, which says why it is refused if it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from swarmd.inference.registry import Registry
from swarmd.inference.stage.book import Sampled, StageBook, Work, finish_reason
from swarmd.inference.stage.job import Loaded
from swarmd.transport.lane import DECLINE, Ahead, Known, Taken
from swarmd.transport.transport import HandlerResult, Send, as_sends
from swarmd.wire.codec import WireTensor
from swarmd.wire.follow import Follower, NextForward, NextToken, free_of, token_free
from swarmd.wire.messages import Forward, Message, Token

log = logging.getLogger(__name__)

OutKey = tuple[str, str, int]  # (peer, message tag, hop): where a layout frames the next message


@dataclass(frozen=True)
class Expected:
    """The frame of a request's next step from `peer`, and what the stage held when it ran the one before."""

    peer: str
    follower: Follower
    request_id: str
    book: StageBook  # the book the last step went through
    model: Any  # models.stage.StageModel
    registry: Registry
    hidden_dtype: str  # a Forward's tensor dtype ("" on stage 0, whose input is the token)
    hidden_size: int

    @property
    def step(self) -> int:
        """The step it runs (a token sampled at step s is the input of step s + 1)."""
        e = self.follower.expected
        return e.step + 1 if isinstance(e, NextToken) else e.step

    @property
    def key(self) -> tuple[str, str, int, int]:
        e = self.follower.expected
        return (Token.TAG if isinstance(e, NextToken) else Forward.TAG, self.request_id, e.step, e.hop)

    @property
    def start_pos(self) -> int | None:
        e = self.follower.expected
        return e.start_pos if isinstance(e, NextForward) else None

    @property
    def epoch(self) -> int | None:
        e = self.follower.expected
        return e.epoch if isinstance(e, NextForward) else None

    def then(self) -> Expected:
        return Expected(self.peer, self.follower.then(), self.request_id, self.book, self.model, self.registry,
                        self.hidden_dtype, self.hidden_size)

    def input(self, body: bytes) -> np.ndarray:
        """The step's input from a matching frame: the token id, or the hidden row (a view of `body`)."""
        if not self.hidden_dtype:
            return np.asarray([self.follower.token(body)], dtype=np.int32)
        free = self.follower.free_bytes(body)
        if self.hidden_dtype == "float32":  # (what `to_array` gives, without building the tensor)
            return np.frombuffer(free, np.float32).reshape(1, self.hidden_size)
        return WireTensor(self.hidden_dtype, (1, self.hidden_size), free).to_array("float32")


@dataclass(frozen=True)
class Ran:
    """A step whose model ran (`StageActor.take_next`): its work, its output where the book moved the request
    past it (None: the step failed, the request is gone, or the daemon stops), and `finish(written)`, which
    builds its outputs, the chain's input first (`written`: the perf_counter when that one was framed ahead of
    them; 0.0 if it was not). `finish` must be called: until then the stage is busy."""

    work: Work
    output: np.ndarray | Sampled | None
    finish: Callable[[float], HandlerResult]


def expected_after(peer: str, msg: Forward | Token, work_rows: int, book: StageBook,
                   loaded: Loaded) -> Expected | None:
    """The frame of the step after `msg`'s, which ran on the lane with `book` and `loaded`; None where the next
    step is left to the general path."""
    state = book.requests.get(msg.request_id)
    model = loaded.model
    if state is None or state.sampling.speculative or work_rows != 1 or getattr(model, "moe_blocks", ()):
        return None
    if isinstance(msg, Token):
        this: NextForward | NextToken | None = NextToken.of(msg)
        dtype = ""
    else:
        this = NextForward.of(msg) if msg.hidden is not None else None
        dtype = msg.hidden.dtype if msg.hidden is not None else ""
    if this is None:
        return None
    return Expected(peer, Follower(this.then()), msg.request_id, book, model, loaded.registry, dtype,
                    model.hidden_size)


class NextStep:
    """The stage's shortcut on the lane: the one next step it expects, learnt once the lane ran a step
    (`ran`: `StageActor.expect_after` for one `take_hot` ran, the step after for one taken here), run by
    `StageActor.take_next`, which answers as a hot handler does. Its outputs are framed from the layout of the
    last frame sent to the same peer where they follow it (`_framing`), else encoded as any message."""

    def __init__(self, run: Callable[[Expected, bytes, float], Ran | Any],
                 learn: Callable[[str, Forward | Token], Expected | None]) -> None:
        self._run, self._learn = run, learn
        self._expected: Expected | None = None
        self._out: dict[OutKey, Follower] = {}  # the next frame to each (peer, message tag, hop)
        self._framed: list[OutKey] = []  # ... those the step being taken framed
        self.mismatched = 0  # steps whose output was not the frame written ahead of it (a bug: logged)

    def expect(self, expected: Expected | None) -> None:
        self._expected = expected

    def follows(self, peer: str, body: bytes) -> Known | None:
        e = self._expected
        if e is None or peer != e.peer:
            return None
        seq = e.follower.seq(body)
        if seq is None:
            return None
        if not e.hidden_dtype:  # a token outside the vocabulary is refused by the general path's check
            if e.follower.token(body) >= e.book.vocab_size:
                return None
            return Known(e.key, seq, Token.TAG, e)
        return Known(e.key, seq, Forward.TAG, e)

    def take(self, known: Known, body: bytes, arrived: float) -> Taken | Ahead | Any:
        ran = self._run(known.expected, body, arrived)
        if ran is DECLINE:
            return ran
        self._framed.clear()
        try:
            ahead = self._ahead(known.expected, ran)
        except Exception:  # ours to fix: the step's outputs go as any others
            log.exception("step %d of %s: its output's frame", ran.work.step, ran.work.request_id)
            ahead = None
        if ahead is None:
            return self._taken(as_sends(ran.finish(0.0)))
        key, f, free = ahead
        framed = [0.0]

        def frame(seq: int) -> bytes:
            framed[0] = time.perf_counter()
            return f.frame_free(seq, free)

        return Ahead(key[0], frame, lambda: self._then(ran, key, f, free, framed[0]))

    def _ahead(self, e: Expected, ran: Ran) -> tuple[OutKey, Follower, bytes | memoryview] | None:
        """Where the step's output down the chain goes, its layout and its free bytes, if the output follows
        the last frame sent there (what `book.outputs` will give for this step: `_then` checks it)."""
        out, work, book = ran.output, ran.work, e.book
        state = book.requests.get(work.request_id)
        if state is None:
            return None
        if isinstance(out, Sampled):  # the last stage: stage 0's token, unless it ends the request
            if out.logprob is not None or out.top or finish_reason(out.token, work.step, work.start_pos + 1,
                                                                   state.sampling, book.max_context):
                return None
            key: OutKey = (e.registry.stage_peer(0), Token.TAG, 0)
            free: bytes | memoryview = token_free(out.token)
        elif isinstance(out, np.ndarray) and book.wire_dtype is None:
            key = (e.registry.next_peer(book.hop) or "", Forward.TAG, book.hop + 1)
            free = memoryview(np.ascontiguousarray(out, np.float32)).cast("B")
        else:
            return None
        f = self._out.get(key)
        if f is None or f.expected.request_id != work.request_id or f.expected.step != work.step or len(free) != f.free:
            return None
        x = f.expected
        if isinstance(x, NextForward) and (x.start_pos, x.epoch, x.head) != (work.start_pos, state.epoch, state.head):
            return None
        return key, f, free

    def _then(self, ran: Ran, key: OutKey, f: Follower, free: bytes | memoryview, framed: float) -> Taken:
        """The step written `Ahead` (framed at `framed`; 0.0 if the lane could not take it): its sends, built now,
        the first the message that frame was (checked)."""
        sends = as_sends(ran.finish(framed))
        first = sends[0] if sends else None
        if first is None or first.peer != key[0] or not f.expected.describes(first.msg) or (
                bytes(free_of(first.msg)) != bytes(free)):
            if first is not None:  # (none: the stage was replaced meanwhile)
                self.mismatched += 1
                log.error("the frame written ahead of step %d of %s is not its output %s", ran.work.step,
                          ran.work.request_id, first.msg.TAG)
            return self._taken(sends)
        self._framed.append(key)
        return Taken(sends, (None, *(self._framing(s.peer, s.msg) for s in sends[1:])), ahead=True)

    def _taken(self, sends: list[Send]) -> Taken:
        return Taken(tuple(sends), tuple(self._framing(s.peer, s.msg) for s in sends))

    def _framing(self, peer: str, msg: Message) -> Follower | None:
        """The layout that frames `msg` to `peer`, if it is the one after the last sent there of its kind."""
        if not isinstance(msg, Forward | Token):
            return None
        key = (peer, msg.TAG, msg.hop)
        f = self._out.get(key)
        if f is None or not f.expected.describes(msg):
            this = NextForward.of(msg) if isinstance(msg, Forward) else NextToken.of(msg)
            if this is None:
                self._out.pop(key, None)
                return None
            f = self._out[key] = Follower(this)
        self._framed.append(key)  # the layout moves on once the frame is written (`ran`)
        return f

    def ran(self, peer: str, what: Any) -> None:
        if isinstance(what, Known):
            if self._expected is what.expected:
                self._expected = what.expected.then()
            for key in self._framed:
                self._out[key] = self._out[key].then()
            self._framed.clear()
        elif isinstance(what, Forward | Token):
            expected = self._learn(peer, what)
            if expected is not None:
                self._expected = expected
