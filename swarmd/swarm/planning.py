"""Who plans and which plan counts: a sans-IO state machine beside the election.

Leader side: when the set of members it plans over changes (membership, a member whose load failed, or
one that now has memory to give), it waits for the change to settle (debounce; only `replan_after_loss` when a member that
holds a stage of the plan in force is gone, or the last holder of one of its routed experts: every
request through it waits for the new plan), asks for a plan with an epoch above every
epoch it has seen, publishes it, and repeats it now and then for late joiners. Load changes never
cause a re-plan: they are not part of the basis. A new leader always plans on taking office.

Member side: only the current leader's plan for the current term is accepted, and only if it is
newer (term, then epoch) than the one in force. A plan that arrives before its leader is known, or
for a term the election has not reached yet, is kept and accepted once the election agrees. Every
other plan is rejected with a reason (`PlanRejected`): "stale" (an older term or epoch: a replay, or a
late copy), "conflicting" (the leader's epoch in force with other contents), "not_leader" (signed by a
member that does not lead the current term). Forged plans (bad signatures, published by another peer)
never get here: `swarmd.wire.gossip.decode` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.node import NodeDescriptor
from planner.plan import Plan
from swarmd.config import Timings
from swarmd.net.identity import short_id
from swarmd.wire.gossip import PlanAnnouncement


@dataclass(frozen=True)
class Basis:
    """What a plan depends on: the members planned over, the ones excluded for failing to load, and those
    that can take work (memory to give): a member that becomes able to is planned for, not only one that joins."""

    peers: frozenset[str]
    excluded: frozenset[str] = frozenset()
    ready: frozenset[str] | None = None  # None: every member planned over


def ready_members(nodes: tuple[NodeDescriptor, ...]) -> frozenset[str]:
    """The members with memory to give a plan (the planner gives work to those only)."""
    return frozenset(n.peer_id for n in nodes if n.memory_free > 0)


# --- inputs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Leadership:
    term: int
    leader: str | None


@dataclass(frozen=True)
class Candidates:
    """The live, compatible members (self included) and `(peer, incarnation)` pairs whose load failed."""

    nodes: tuple[NodeDescriptor, ...]
    failed_loads: frozenset[tuple[str, int]] = frozenset()


@dataclass(frozen=True)
class EpochSeen:
    epoch: int


@dataclass(frozen=True)
class Announced:
    announcement: PlanAnnouncement


@dataclass(frozen=True)
class PlanMade:
    plan: Plan
    basis: Basis
    term: int


@dataclass(frozen=True)
class PlanFailed:
    reason: str
    basis: Basis
    term: int


PlanningInput = Leadership | Candidates | EpochSeen | Announced | PlanMade | PlanFailed


# --- actions ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MakePlan:
    nodes: tuple[NodeDescriptor, ...]
    epoch: int
    term: int
    previous: Plan | None
    basis: Basis


@dataclass(frozen=True)
class PublishPlan:
    announcement: PlanAnnouncement


@dataclass(frozen=True)
class PlanAccepted:
    announcement: PlanAnnouncement


@dataclass(frozen=True)
class PlanError:
    reason: str


@dataclass(frozen=True)
class PlanRejected:
    announcement: PlanAnnouncement
    reason: str  # stale | conflicting | not_leader
    detail: str


PlanningAction = MakePlan | PublishPlan | PlanAccepted | PlanError | PlanRejected


def plan_broken(plan: Plan, peers: frozenset[str]) -> bool:
    """Whether `plan` cannot serve a token with only `peers` left: a stage's node, or every holder of some
    routed expert, is gone (a lost replica leaves the plan whole)."""
    if any(s.peer_id not in peers for s in plan.stages):
        return True
    return any(not peers.intersection(holders) for by in plan.experts.values() for holders in by.values())


MAX_WAITING = 64  # plans held for a leader the election has not agreed on yet


@dataclass
class PlanCoordinator:
    self_id: str
    timings: Timings
    term: int = 0
    leader: str | None = None
    current: PlanAnnouncement | None = None
    max_epoch_seen: int = 0
    nodes: tuple[NodeDescriptor, ...] = ()
    basis: Basis = Basis(frozenset())
    basis_changed_at: float = 0.0
    planned: tuple[int, Basis] | None = None  # (term, basis) of the last plan this node made
    chain_broken: bool = False  # the basis lost a member that holds a stage of the plan in force
    in_flight: bool = False
    last_publish: float = float("-inf")
    error: str = ""
    failed: set[tuple[str, int]] = field(default_factory=set)
    waiting: dict[str, PlanAnnouncement] = field(default_factory=dict)  # leader -> newest plan

    @property
    def is_leader(self) -> bool:
        return self.leader == self.self_id

    @property
    def epoch(self) -> int:
        return self.current.plan.epoch if self.current else 0

    def handle(self, msg: PlanningInput, now: float) -> list[PlanningAction]:
        if isinstance(msg, Leadership):
            if (msg.term, msg.leader) != (self.term, self.leader):
                self.term, self.leader = msg.term, msg.leader
                self.basis_changed_at = now
                self.error = ""
                return self._accept_waiting()
            return []
        if isinstance(msg, Candidates):
            self.failed |= msg.failed_loads
            self.nodes = tuple(sorted(msg.nodes, key=lambda n: n.peer_id))
            excluded = frozenset(n.peer_id for n in self.nodes if (n.peer_id, n.incarnation) in self.failed)
            peers = frozenset(n.peer_id for n in self.nodes) - excluded
            basis = Basis(peers, excluded, ready_members(tuple(n for n in self.nodes if n.peer_id in peers)))
            if basis != self.basis:
                self.chain_broken = self.current is not None and plan_broken(self.current.plan, basis.peers)
                self.basis, self.basis_changed_at = basis, now
            return []
        if isinstance(msg, EpochSeen):
            self.max_epoch_seen = max(self.max_epoch_seen, msg.epoch)
            return []
        if isinstance(msg, Announced):
            return self._on_announcement(msg.announcement)
        if isinstance(msg, PlanMade):
            self.in_flight = False
            self.max_epoch_seen = max(self.max_epoch_seen, msg.plan.epoch)
            if not self.is_leader or msg.term != self.term:
                return []
            self.planned, self.error = (msg.term, msg.basis), ""
            ann = PlanAnnouncement(self.self_id, self.term, msg.plan)
            self.current, self.last_publish = ann, now
            return [PlanAccepted(ann), PublishPlan(ann)]
        if isinstance(msg, PlanFailed):
            self.in_flight = False
            if self.is_leader and msg.term == self.term:
                self.planned, self.error = (msg.term, msg.basis), msg.reason
                return [PlanError(msg.reason)]
            return []
        raise TypeError(f"not a planning input: {msg!r}")

    def tick(self, now: float) -> list[PlanningAction]:
        if not self.is_leader or self.in_flight:
            return []
        debounce = self.timings.replan_after_loss if self.chain_broken else self.timings.replan_debounce
        settled = now - self.basis_changed_at >= min(debounce, self.timings.replan_debounce)
        if self.planned != (self.term, self.basis) and settled and self.basis.peers:
            self.in_flight = True
            nodes = tuple(n for n in self.nodes if n.peer_id in self.basis.peers)
            epoch = max(self.max_epoch_seen, self.epoch) + 1
            return [MakePlan(nodes, epoch, self.term, self.current.plan if self.current else None, self.basis)]
        if (self.current is not None and self.current.leader == self.self_id and self.current.term == self.term
                and now - self.last_publish >= self.timings.plan_republish_interval):
            self.last_publish = now
            return [PublishPlan(self.current)]
        return []

    def _on_announcement(self, ann: PlanAnnouncement) -> list[PlanningAction]:
        self.max_epoch_seen = max(self.max_epoch_seen, ann.plan.epoch)
        if ann.leader == self.self_id:
            return []  # our own, echoed by the gossip layer
        cur = self.current
        if cur is not None and (ann.leader, ann.term) == (cur.leader, cur.term):
            if ann.plan.epoch == cur.plan.epoch:
                if ann.plan == cur.plan:
                    return []  # the leader repeating its plan for late joiners
                return [PlanRejected(ann, "conflicting", f"epoch {ann.plan.epoch} of term {ann.term} is in force "
                                                         "with other contents")]
            if ann.plan.epoch < cur.plan.epoch:
                return [PlanRejected(ann, "stale", f"epoch {ann.plan.epoch} is older than epoch "
                                                   f"{cur.plan.epoch} in force")]
        if ann.term < self.term:
            return [PlanRejected(ann, "stale", f"term {ann.term} is over (the current term is {self.term})")]
        if ann.term == self.term and self.leader is not None and ann.leader != self.leader:
            return [PlanRejected(ann, "not_leader", f"the leader of term {self.term} is {short_id(self.leader)}")]
        held = self.waiting.get(ann.leader)
        if held is None or (ann.term, ann.plan.epoch) > (held.term, held.plan.epoch):
            self.waiting[ann.leader] = ann
            if len(self.waiting) > MAX_WAITING:  # forget the plan of the lowest term
                del self.waiting[min(self.waiting, key=lambda p: (self.waiting[p].term, p))]
        return self._accept_waiting()

    def _accept_waiting(self) -> list[PlanningAction]:
        if self.leader is None or self.is_leader:
            return []
        ann = self.waiting.get(self.leader)
        if ann is None or ann.term != self.term:
            return []
        if self.current is not None and (ann.term, ann.plan.epoch) <= (self.current.term, self.current.plan.epoch):
            return []
        self.current = ann
        return [PlanAccepted(ann)]
