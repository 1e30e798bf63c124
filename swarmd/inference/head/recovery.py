"""Moving a request to a new chain: when, what to send, and how long each part of it took. No I/O: the head
service (`swarmd.inference.head.service`) does it; `Recovery.wait_says` is async only to be its `OnWait`.

A request's chain is the plan's stages when the head sent it. When a new plan changes that chain (a stage
died, left, or the blocks moved) or a stage says it no longer holds the request, the head moves it: it
waits for the new chain to be ready, forgets the old attempt (cancels it on the old stages) and replays the
request's token history (the prompt and every token generated so far) through the new chain as a new attempt
(`{request_id}.r{n}`), whose first Forward is the step of the next token, from position 0. Every stage
rebuilds the request's KV cache from that replay; the last stage samples the next token with the request's
seed at that step, so the tokens are those an undisturbed run gives, and the head's session drops any token
it already has (by step), so the client sees no repeat and no gap.

When the new chain keeps some of the old stages, block range for block range (a standby took a dead stage's
place), the replay names the old attempt (`resume_of`) and is not cancelled on those stages: they keep its KV
cache and only the new stages rebuild theirs (`swarmd.inference.head.hop_local`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from swarmd.inference.registry import Registry
from swarmd.wire.codec import WireTensor
from swarmd.wire.messages import Forward, Sampling

# Stage errors that say the request's chain is gone or changed under it (not that the request is wrong):
# the head moves the request instead of failing it.
CHAIN_ERRORS = frozenset({"not_ready", "unknown_request", "wrong_hop", "not_a_stage", "out_of_order", "bad_position",
                          "duplicate_request", "unreachable", "resume_failed", "stale_plan"})
MAX_MOVES = 8  # a request moved this often without progress fails: the swarm is not settling


def chain_of(registry: Registry) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """What a request depends on: which peers hold which blocks, in order (not the plan's epoch)."""
    return registry.stages, registry.layers


def chain_changed(sent_on: Registry, now: Registry) -> bool:
    return bool(now.stages) and chain_of(sent_on) != chain_of(now)


def attempt_id(request_id: str, attempt: int) -> str:
    """The id the stages know attempt `attempt` of a request by (a fresh one per move: no stage state is shared)."""
    return request_id if attempt == 0 else f"{request_id}.r{attempt}"


def replay_forward(request_id: str, attempt: int, head: str, prompt: tuple[int, ...], generated: list[int],
                   sampling: Sampling, epoch: int, *, prompt_scores: bool, resume_of: str = "") -> Forward:
    """Stage 0's first Forward of a moved request: every token so far, from position 0, at the next step,
    continuing the attempt `resume_of` on the stages that still hold it.

    A request still owed its prompt's log-probs starts again from step 0 (the scores come from the prefill;
    nothing is resumed)."""
    if prompt_scores:
        ids = np.asarray(prompt, dtype=np.int32)
        return Forward(attempt_id(request_id, attempt), 0, 0, 0, head, tokens=WireTensor.from_array(ids),
                       epoch=epoch, all_logits=True, sampling=sampling, targets=WireTensor.from_array(ids[1:]))
    ids = np.asarray((*prompt, *generated), dtype=np.int32)
    return Forward(attempt_id(request_id, attempt), len(generated), 0, 0, head, tokens=WireTensor.from_array(ids),
                   epoch=epoch, sampling=sampling, resume_of=resume_of)


@dataclass
class Recovery:
    """One move of a request, as perf_counter seconds; `to_json` gives the parts in seconds."""

    reason: str
    noticed: float  # the head saw the new plan or the stage's error
    ready: float = 0.0  # the new chain was ready (every stage loaded)
    sent: float = 0.0  # the replay went to stage 0
    first_token: float = 0.0  # the first new token came back (the KV caches are rebuilt)
    replayed_tokens: int = 0
    kept_hops: tuple[int, ...] = ()  # stages that kept the request's KV cache (hop-local rebuild); () full replay
    epoch: int = 0
    waiting: str = ""  # what the new chain was last waiting for

    async def wait_says(self, detail: str) -> None:
        self.waiting = detail

    def to_json(self) -> dict[str, Any]:
        def span(a: float, b: float) -> float | None:
            return round(b - a, 4) if a and b else None

        return {"reason": self.reason, "epoch": self.epoch, "replayed_tokens": self.replayed_tokens,
                "rebuild": "hop_local" if self.kept_hops else "full_replay", "kept_hops": list(self.kept_hops),
                "wait_for_chain_s": span(self.noticed, self.ready), "replay_s": span(self.sent, self.first_token),
                "total_s": span(self.noticed, self.first_token)}
