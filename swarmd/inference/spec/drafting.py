"""What a drafter is: a source of proposed next tokens for one request, on the head.

`NgramSource` (prompt lookup, `swarmd.inference.spec.ngram`) and `ModelDrafter` (a small draft model with the
target's vocabulary, `swarmd.inference.spec.draft_model`) both follow `Drafter`: they are told the tokens the
target accepted, in order, and asked for up to k proposals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from swarmd.inference.spec.ngram import NgramDrafter


@dataclass(frozen=True)
class Proposal:
    tokens: tuple[int, ...]


EMPTY = Proposal(())


class Drafter(Protocol):
    blocking: bool  # propose() computes (run it on the compute thread), or it is a quick lookup

    def accept(self, tokens: Sequence[int]) -> None: ...
    def propose(self, k: int, step: int) -> Proposal: ...
    def close(self) -> None: ...


class NgramSource:
    """Prompt lookup as a `Drafter`."""

    blocking = False

    def __init__(self, context: Sequence[int]) -> None:
        self.ngram = NgramDrafter(context)

    def accept(self, tokens: Sequence[int]) -> None:
        self.ngram.extend(tokens)

    def propose(self, k: int, step: int) -> Proposal:
        return Proposal(tuple(self.ngram.propose(k)))

    def close(self) -> None:
        pass
