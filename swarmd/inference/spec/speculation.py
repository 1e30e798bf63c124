"""One request's speculation on its head, and the daemon's counters of it. No I/O.

The head sends a speculative request's prompt as usual; from then on the last stage answers every step to the head
with a `Verified` (the tokens the step yielded) instead of closing the loop at stage 0, and the head sends the next
step: the last token and the k tokens its drafter proposes, one verify step of k + 1 rows (`verify_forward`). k
comes from `AdaptiveK`, bounded by the tokens and context the request has left.

    spec = Speculation(settings, drafter, prompt_len=12, max_tokens=64, max_context=2048)
    drafted, accepted = spec.on_result(verified, now, taken)   # the tokens the session took
    k = spec.next_k(next_step)                              # then drafter.propose(k, next_step)
    msg = verify_forward(request_id, next_step, prompt_len + next_step - 1, head, last, proposal, epoch)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from swarmd.inference.spec.adaptive import PROBES, PROBES_MODEL, AdaptiveK, Learned
from swarmd.inference.spec.drafting import Drafter, Proposal
from swarmd.spec_settings import SpecSettings
from swarmd.wire.codec import WireTensor
from swarmd.wire.messages import Draft, Forward, Verified

ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)  # drafted tokens accepted per pass (histogram bounds)


@dataclass
class SpecStats:
    """Counters of the speculative passes a daemon headed (for /metrics, `swarmd status` and benchmarks)."""

    drafted: int = 0  # tokens drafted and sent for verification
    accepted: int = 0  # drafted tokens the target accepted
    passes: int = 0  # verify passes through the chain (a step of a speculative request after its prompt)
    draft_seconds: float = 0.0  # time spent drafting
    rejections: int = 0  # passes that ended at a rejected draft (the others accepted every draft)
    buckets: list[int] = field(default_factory=lambda: [0] * len(ACCEPTED_BUCKETS))  # passes per upper bound
    over: int = 0  # passes with more accepted than the last bound
    bounds: ClassVar[tuple[int, ...]] = ACCEPTED_BUCKETS  # the buckets' upper bounds

    def record_pass(self, drafted: int, accepted: int) -> None:
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += int(accepted < drafted)
        i = bisect.bisect_left(ACCEPTED_BUCKETS, accepted)
        if i < len(self.buckets):
            self.buckets[i] += 1
        else:
            self.over += 1

    def merge(self, other: SpecStats) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.passes += other.passes
        self.draft_seconds += other.draft_seconds
        self.rejections += other.rejections
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]
        self.over += other.over

    def to_json(self) -> dict[str, Any]:
        return {"passes": self.passes, "drafted": self.drafted, "accepted": self.accepted, "rejections": self.rejections,
                "draft_seconds": round(self.draft_seconds, 6),
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
                # the chance that a draft is accepted given the ones before it were (accepted until the first
                # rejection: successes over trials), as planner.simulate's `acceptance` means it
                "token_acceptance": round(self.accepted / (self.accepted + self.rejections), 4)
                if self.accepted + self.rejections else None,
                "tokens_per_pass": round((self.passes + self.accepted) / self.passes, 4) if self.passes else None,
                "accepted_length": {str(b): n for b, n in zip(ACCEPTED_BUCKETS, self.buckets, strict=True)}
                | ({"+Inf": self.over} if self.over else {})}


class Speculation:
    """A speculative request on its head: the drafter, the controller of k, and what its passes did."""

    def __init__(self, settings: SpecSettings, drafter: Drafter, *, prompt_len: int, max_tokens: int,
                 max_context: int, learned: Learned | None = None) -> None:
        self.settings = settings
        self.drafter = drafter
        self.prompt_len, self.max_tokens, self.max_context = prompt_len, max_tokens, max_context
        self.control = AdaptiveK.starting_from(learned or Learned(), settings.draft_tokens, adaptive=settings.adaptive,
                                               probes=PROBES_MODEL if drafter.blocking else PROBES)
        self.stats = SpecStats()
        self.in_flight: Proposal | None = None  # the draft of the pass sent last
        self.sent_at: float = 0.0
        self._last_result: float | None = None
        # Who closes the loop: the head (it drafts each step) or, while drafting does not pay, the chain itself
        # (the last stage sends each token to stage 0, as without speculation, and the head only watches).
        self.head_drives = True
        self.taking_over = False  # the head asked the last stage for the loop back; no answer yet
        self.planned_k: int | None = None  # the k that made the head take the loop back
        self._guess: int | None = None  # while the chain drives: prompt lookup's guess of the next token

    def on_result(self, msg: Verified, now: float, taken: Sequence[int]) -> tuple[int, int]:
        """A step's tokens came back and the session took `taken` of them (all, but after a move or the end):
        (drafted, accepted) of that pass (0, 0 for the prompt's step). The drafter learns the tokens taken; the
        controller the acceptance and the time since the last result."""
        drafted = msg.drafted
        accepted = min(len(msg.tokens) - 1, drafted) if drafted else 0
        if msg.step > 0:
            self.stats.record_pass(drafted, accepted)
            seconds = None if self._last_result is None else now - self._last_result
            self.control.observe(drafted, accepted, seconds)
        self._last_result = now
        self.in_flight = None
        self.drafter.accept(taken)
        return drafted, accepted

    def next_k(self, next_step: int) -> int:
        """Drafts for the step `next_step`: the controller's choice (or the one that took the loop back), within the
        tokens and context left."""
        start = self.prompt_len + next_step - 1  # the position of the last accepted token
        room = min(self.max_tokens - 1 - next_step, self.max_context - 1 - start)
        k = self.planned_k if self.planned_k is not None else self.control.next_k()
        self.planned_k = None
        return max(0, min(k, room))

    def hands_back(self, k: int) -> bool:
        """Whether a step of `k` drafts gives the loop back to the chain: the controller chose none."""
        return k == 0 and self.control.adaptive

    def handed_back(self) -> None:
        self.head_drives, self._last_result = False, None

    def on_chain_tokens(self, taken: Sequence[int], next_step: int) -> bool:
        """Tokens that came round the chain while it drives: the drafter learns them, prompt lookup's guesses are
        scored against them (acceptance seen without drafting); True when the head should take the loop back."""
        for token in taken:
            if self._guess is not None:
                self.control.observe(1, int(token == self._guess))
            self.drafter.accept([token])
            self._guess = None
            if not self.drafter.blocking:  # a lookup costs nothing: guess the next token
                guess = self.drafter.propose(1, next_step).tokens
                self._guess = guess[0] if guess else None
        if self.taking_over or self.head_drives or not taken:
            return False
        k = self.next_k(next_step)
        if k > 0:
            self.taking_over, self.planned_k = True, k
        return k > 0

    def on_verified(self) -> None:
        """The last stage answered the head: the head drives."""
        self.head_drives, self.taking_over, self._guess = True, False, None


def verify_forward(request_id: str, step: int, start_pos: int, head: str, last: int, proposal: Proposal,
                   epoch: int, *, chain: bool = False) -> Forward:
    """Stage 0's input for a speculative step: the last accepted token, then the drafted ones (if any); with
    `chain`, the step that hands the loop back to the chain."""
    rows = np.asarray((last, *proposal.tokens), dtype=np.int32)
    draft = None
    if proposal.tokens:
        draft = Draft(WireTensor.from_array(rows[1:]))
    return Forward(request_id, step, 0, start_pos, head, tokens=WireTensor.from_array(rows), epoch=epoch, draft=draft,
                   chain=chain)
