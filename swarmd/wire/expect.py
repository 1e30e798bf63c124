"""What a receiver expects of a message beyond its own consistency: sizes and dtypes from the Plan.

An `Expect` is a callable run on every decoded message of its type before the frame is acked; it raises
WireError, which the transport sends back as an `Error` frame. A stage builds its expectations from the
Plan it serves (hidden size, vocabulary, the hop it is) and from the wire dtype setting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from swarmd.wire.codec import WireTensor
from swarmd.wire.messages import ExpertBatch, ExpertResult, Forward, Message, Token, Verified, need

Expect = Callable[[Message], None]


def _hidden(t: WireTensor, what: str, hidden_size: int, dtypes: frozenset[str], max_rows: int) -> None:
    need(t.shape[1] == hidden_size, f"{what} has width {t.shape[1]}, the model's hidden size is {hidden_size}",
         "bad_shape")
    need(t.dtype in dtypes, f"{what} dtype {t.dtype} is not accepted here (accepted: {sorted(dtypes)})", "bad_dtype")
    need(0 < t.shape[0] <= max_rows, f"{what} has {t.shape[0]} rows, accepted 1..{max_rows}", "bad_shape")


def _token_ids(t: WireTensor, what: str, vocab_size: int) -> None:
    ids = t.to_array()
    need(bool(ids.size == 0 or (ids.min() >= 0 and ids.max() < vocab_size)),
         f"{what} outside the vocabulary of {vocab_size}", "bad_token")


@dataclass(frozen=True)
class ExpectForward:
    """Stage `hop` of a model with `hidden_size`: stage 0 takes token ids, the others hidden states."""

    hop: int
    hidden_size: int
    vocab_size: int
    dtypes: frozenset[str] = frozenset({"float32"})
    max_rows: int = 8192
    max_pos: int = 1 << 20

    def __call__(self, msg: Message) -> None:
        assert isinstance(msg, Forward)
        need(msg.hop == self.hop, f"forward for hop {msg.hop} sent to hop {self.hop}", "wrong_hop")
        need(msg.start_pos + msg.rows <= self.max_pos, f"positions up to {msg.start_pos + msg.rows} exceed the "
             f"context of {self.max_pos}", "bad_shape")
        if self.hop == 0:
            need(msg.tokens is not None, "stage 0 takes token ids, not hidden states", "bad_shape")
            assert msg.tokens is not None
            need(0 < msg.tokens.shape[0] <= self.max_rows, f"{msg.tokens.shape[0]} tokens, accepted 1..{self.max_rows}",
                 "bad_shape")
            _token_ids(msg.tokens, "token ids", self.vocab_size)
        else:
            need(msg.hidden is not None, f"stage {self.hop} takes hidden states, not token ids", "bad_shape")
            assert msg.hidden is not None
            _hidden(msg.hidden, "hidden", self.hidden_size, self.dtypes, self.max_rows)
        if msg.targets is not None:
            _token_ids(msg.targets, "targets", self.vocab_size)
        if msg.draft is not None:
            _token_ids(msg.draft.tokens, "drafted tokens", self.vocab_size)


@dataclass(frozen=True)
class ExpectToken:
    vocab_size: int

    def __call__(self, msg: Message) -> None:
        assert isinstance(msg, Token)
        need(msg.token < self.vocab_size, f"token {msg.token} outside the vocabulary of {self.vocab_size}",
             "bad_token")


@dataclass(frozen=True)
class ExpectVerified:
    vocab_size: int

    def __call__(self, msg: Message) -> None:
        assert isinstance(msg, Verified)
        need(max(msg.tokens) < self.vocab_size, f"token {max(msg.tokens)} outside the vocabulary of {self.vocab_size}",
             "bad_token")


@dataclass(frozen=True)
class ExpectExpertBatch:
    """An expert node of `block` range with `hidden_size`, taking up to `max_slots` experts per row."""

    hidden_size: int
    n_experts: int
    max_slots: int
    dtypes: frozenset[str] = frozenset({"float32"})
    max_rows: int = 8192

    def __call__(self, msg: Message) -> None:
        assert isinstance(msg, ExpertBatch)
        _hidden(msg.hidden, "hidden", self.hidden_size, self.dtypes, self.max_rows)
        need(msg.expert_ids.shape[1] <= self.max_slots, f"{msg.expert_ids.shape[1]} expert slots per row, "
             f"at most {self.max_slots}", "bad_shape")
        ids = msg.expert_ids.to_array()
        need(bool(ids.size == 0 or (ids.min() >= -1 and ids.max() < self.n_experts)),
             f"expert ids outside -1..{self.n_experts - 1}", "bad_expert")


@dataclass(frozen=True)
class ExpectExpertResult:
    hidden_size: int
    dtypes: frozenset[str] = frozenset({"float32"})
    max_rows: int = 8192

    def __call__(self, msg: Message) -> None:
        assert isinstance(msg, ExpertResult)
        _hidden(msg.hidden, "hidden", self.hidden_size, self.dtypes, self.max_rows)
