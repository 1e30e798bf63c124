"""Leader election: a sans-IO state machine over claims (term, leader) carried by heartbeats.

Rules, applied after every input:
1. Not admitted yet: no leader.
2. Among my own claim and every claim a non-dead member made for a non-dead leader, the best one
   wins: the higher term, and on equal terms the lower leader id. Adopting it is how views that
   diverged (a partition, two founders) converge once they can talk again.
3. If that leaves no leader, or the leader is dead, the live member with the lowest peer id
   becomes leader on a term above every term seen.

So the incumbent stays leader while it is alive (suspect still counts as alive), a new leader
always has a higher term, and every node that sees the same members picks the same leader.

A term is a ballot, as in Paxos: its round in the high bits and a tag of its leader's peer id in the low
ones (`new_term`). Two sides of a partition that each elect a leader then pick different terms, so a term
names one leader wherever it is seen; `term_round` is the part people read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from swarmd.net.identity import short_id

TAG_BITS = 32


def new_term(above: int, leader: str) -> int:
    """The first term of the next round after `above`, led by `leader` (no other leader can pick it)."""
    tag = int.from_bytes(hashlib.sha256(leader.encode()).digest()[:4], "big")
    return ((term_round(above) + 1) << TAG_BITS) | tag


def term_round(term: int) -> int:
    """How many times a leader was elected before this term's (what status shows)."""
    return term >> TAG_BITS


@dataclass(frozen=True)
class Claim:
    """Input: `sender`'s heartbeat said `leader` leads on `term`."""

    sender: str
    term: int
    leader: str | None


@dataclass(frozen=True)
class MembersChanged:
    """Input: who is live (alive or suspect, self included) and who is known dead."""

    live: frozenset[str]
    dead: frozenset[str]
    admitted: bool


@dataclass(frozen=True)
class LeaderChanged:
    """Action: a new (term, leader); `leader` None means no leader (not admitted)."""

    term: int
    leader: str | None
    reason: str


ElectionInput = Claim | MembersChanged


def _better(a: tuple[int, str], b: tuple[int, str]) -> bool:
    """Is claim a = (term, leader) better than b?"""
    return a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])


@dataclass
class Election:
    self_id: str
    term: int = 0
    leader: str | None = None
    max_term_seen: int = 0
    claims: dict[str, Claim] = field(default_factory=dict)
    live: frozenset[str] = frozenset()
    dead: frozenset[str] = frozenset()
    admitted: bool = False

    def __post_init__(self) -> None:
        self.live = frozenset({self.self_id})

    @property
    def is_leader(self) -> bool:
        return self.leader == self.self_id

    def handle(self, msg: ElectionInput, now: float) -> list[LeaderChanged]:
        if isinstance(msg, Claim):
            if msg.sender != self.self_id:
                self.claims[msg.sender] = msg
                self.max_term_seen = max(self.max_term_seen, msg.term)
        elif isinstance(msg, MembersChanged):
            self.live, self.dead, self.admitted = msg.live | {self.self_id}, msg.dead, msg.admitted
            for gone in [s for s in self.claims if s in self.dead]:
                del self.claims[gone]
        else:
            raise TypeError(f"not an election input: {msg!r}")
        return self._decide()

    def tick(self, now: float) -> list[LeaderChanged]:
        return self._decide()

    def _decide(self) -> list[LeaderChanged]:
        if not self.admitted:
            if self.leader is None:
                return []
            self.leader = None
            return [LeaderChanged(self.term, None, "not admitted")]
        best: tuple[int, str] | None = None
        if self.leader is not None and self.leader not in self.dead:
            best = (self.term, self.leader)
        for c in self.claims.values():
            if c.leader is None or c.sender in self.dead or c.leader in self.dead:
                continue
            if best is None or _better((c.term, c.leader), best):
                best = (c.term, c.leader)
        if best is not None:
            if best != (self.term, self.leader):
                old = self.leader
                self.term, self.leader = best
                why = "adopted from heartbeats" if old is None else f"adopted over {short_id(old)}"
                return [LeaderChanged(self.term, self.leader, why)]
            return []
        old = self.leader
        self.leader = min(self.live)
        self.term = new_term(max(self.term, self.max_term_seen), self.leader)
        why = "no leader yet" if old is None else f"leader {short_id(old)} is dead"
        return [LeaderChanged(self.term, self.leader, f"elected lowest live peer id ({why})")]
