"""How a MoE router spreads one layer's step over the nodes that hold its experts (pure, no I/O).

`split_by_node` picks one holder per selected expert (`ReplicaChooser`: lowest observed latency
times load, the Plan's nearest-first order breaking ties) and groups the experts by node, so each
node gets one batched `ExpertCall` per layer and step with just the rows that select its experts;
`combine` makes one (rows, dim) answer of the nodes' expert outputs, each row's summed in the order of its
selections (`models.expert_shard.gated_sum`), so the sum is the same bits wherever the experts live. `unserved` and
`give_up_reason` decide what a router does when a selected expert has no usable holder (every one is
dead or failed): wait for a plan that places it on a live node, or fail the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from models.moe import ExpertCall, gated_sum, rows_for


@dataclass
class ReplicaChooser:
    """Per-peer round-trip latency (exponentially weighted) and calls in flight.

    An estimate that no new call refreshes relaxes toward the prior (`half_life_s`): a holder that was slow
    once (compiling its first batch) or failed (restarted since) is tried again after a while instead of
    being shunned for good while another holder answers. `clock` says the time in seconds (the router's
    event loop's)."""

    clock: Callable[[], float]
    alpha: float = 0.3  # weight of the newest sample
    prior_s: float = 0.005  # what an unmeasured peer is assumed to take
    failure_penalty: float = 4.0  # a failed call: the slowest estimate times this
    half_life_s: float = 3.0
    latency: dict[str, float] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    sampled_at: dict[str, float] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)  # peers whose latest call failed

    def estimate(self, peer: str) -> float:
        """The peer's latency as believed now (seconds). A peer whose latest call failed stays the failure
        penalty times slower than the slowest peer that answers, also one measured after it failed (relaxing
        with the same half-life)."""
        own = self._relaxed(peer, self.latency.get(peer, self.prior_s))
        if peer not in self.failed:
            return own
        answering = [self._relaxed(p, lat) for p, lat in self.latency.items() if p not in self.failed]
        return max(own, self._relaxed(peer, max(answering, default=self.prior_s) * self.failure_penalty))

    def _relaxed(self, peer: str, latency: float) -> float:
        age = max(0.0, self.clock() - self.sampled_at.get(peer, self.clock()))
        return self.prior_s + (latency - self.prior_s) * 0.5 ** (age / self.half_life_s)

    def cost(self, peer: str) -> float:
        return self.estimate(peer) * (1 + self.in_flight.get(peer, 0))

    def choose(self, holders: tuple[str, ...], avoid: Iterable[str] = ()) -> str | None:
        """The holder to ask (None when every holder is avoided); ties go to the Plan's order."""
        avoid = set(avoid)
        options = [(self.cost(p), i, p) for i, p in enumerate(holders) if p not in avoid]
        return min(options)[2] if options else None

    def started(self, peer: str) -> None:
        self.in_flight[peer] = self.in_flight.get(peer, 0) + 1

    def dropped(self, peer: str) -> None:
        """A call to `peer` is awaited no more (its answer is not wanted): no longer in flight, no verdict on it."""
        self.in_flight[peer] = max(0, self.in_flight.get(peer, 0) - 1)

    def finished(self, peer: str, seconds: float | None) -> None:
        """A call to `peer` ended: after `seconds`, or failed (None)."""
        self.dropped(peer)
        old = self.estimate(peer)
        if seconds is None:  # worse than the slowest peer that answers, until it answers fast again
            self.latency[peer] = max([old, *(self.estimate(p) for p in self.latency)]) * self.failure_penalty
            self.failed.add(peer)
        else:
            self.latency[peer] = (1 - self.alpha) * old + self.alpha * seconds
            self.failed.discard(peer)
        self.sampled_at[peer] = self.clock()


@dataclass(frozen=True)
class NodePart:
    peer: str
    rows: np.ndarray  # indices into the layer call's rows
    call: ExpertCall  # those rows, with only this node's experts selected
    experts: tuple[int, ...]


def split_by_node(call: ExpertCall, holders: Mapping[int, tuple[str, ...]],
                  choose: Callable[[tuple[str, ...]], str | None]) -> list[NodePart]:
    """One part per node that a selected expert of `call` is sent to; raises KeyError for an expert
    with no holder to ask."""
    by_node: dict[str, list[int]] = {}
    for expert in sorted(set(call.sel[call.sel >= 0].tolist())):
        peer = choose(holders.get(expert, ()))
        if peer is None:
            raise KeyError(f"expert {expert} of block {call.layer} has no reachable holder")
        by_node.setdefault(peer, []).append(expert)
    parts = []
    for peer, experts in sorted(by_node.items()):
        part = call.only(frozenset(experts))
        assert part is not None
        parts.append(NodePart(peer, rows_for(call, frozenset(experts)), part, tuple(experts)))
    return parts


def combine(call: ExpertCall, answers: Iterable[tuple[NodePart, np.ndarray]]) -> np.ndarray:
    """The layer's answer from the nodes' expert outputs (each node's: one per selected pair of its part, in
    row-major order): each row's gated sum in the order of its selections, wherever its experts live."""
    n, k = call.sel.shape
    per = np.zeros((n, k, call.rows.shape[1]), np.float32)
    for part, answer in answers:
        mine = np.zeros((n, k), bool)
        mine[part.rows] = part.call.sel >= 0
        per[mine] = answer.astype(np.float32)
    return gated_sum(call, per[call.sel >= 0])


def tokens_per_expert(call: ExpertCall) -> dict[int, int]:
    """How many rows of `call` each expert is asked for (load, for status and re-planning)."""
    experts, counts = np.unique(call.sel[call.sel >= 0], return_counts=True)
    return {int(e): int(c) for e, c in zip(experts, counts, strict=True)}


def unserved(call: ExpertCall, holders: Mapping[int, tuple[str, ...]], unusable: Iterable[str]) -> list[int]:
    """The experts `call` selects that have no holder outside `unusable` (nodes dead or failed this call)."""
    unusable = set(unusable)
    return [e for e in sorted(set(call.sel[call.sel >= 0].tolist()))
            if not any(p not in unusable for p in holders.get(e, ()))]


def give_up_reason(missing: Sequence[int], block: int, waited: float, limit: float,
                   cannot_hold: str | None = None) -> str | None:
    """Why a step whose experts `missing` have no usable holder fails now; None: wait for a new plan.

    The leader re-places the experts of a dead node on survivors; a step waits for that plan up to `limit`
    seconds, and not at all once the swarm is known to be unable to hold them (`cannot_hold`, the leader's
    planning error)."""
    many = len(missing) > 1
    which = f"expert{'s' if many else ''} {', '.join(map(str, missing))} of block {block}"
    has, them = ("have", "them") if many else ("has", "it")
    if cannot_hold:
        return f"{which} {has} no live holder and the swarm cannot hold {them}: {cannot_hold}"
    if waited >= limit:
        return f"{which} {has} no reachable holder and no new plan placed {them} on a live node within {limit:g} s"
    return None
