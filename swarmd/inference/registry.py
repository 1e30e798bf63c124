"""Actor name -> peer id, derived from the current Plan; and whether the plan's chain can serve yet.

Pure: built from a `planner.Plan` (or its JSON) and the members' gossiped assignment states, no I/O.
The pipeline asks it where `stage-{i}` (or `moe-expert-{block}-{idx}`) lives, which hop this daemon is, and, before a request is sent,
whether every stage of the chain is alive and loaded (and if not, a line saying what it waits for).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner.plan import Plan, expert_actor, stage_actor
from swarmd.inference.head.slots import StageSlots
from swarmd.net.identity import short_id


@dataclass(frozen=True)
class Registry:
    """Where each actor of one plan epoch lives."""

    epoch: int
    stages: tuple[str, ...]  # peer id of stage i, in chain order
    layers: tuple[tuple[int, int], ...]  # blocks [start, end) of stage i
    actors: Mapping[str, str]  # actor name -> peer id

    @classmethod
    def from_plan(cls, plan: Plan | None) -> Registry:
        if plan is None:
            return EMPTY
        actors: dict[str, str] = {}
        for i, s in enumerate(plan.stages):
            actors[stage_actor(i)] = s.peer_id
            for name in s.actors:
                actors.setdefault(name, s.peer_id)
        for block, by_expert in plan.experts.items():  # an expert's first holder (the one nearest its stage)
            for expert, holders in by_expert.items():
                if holders:
                    actors.setdefault(expert_actor(block, expert), holders[0])
        return cls(plan.epoch, tuple(s.peer_id for s in plan.stages), tuple(s.layers for s in plan.stages), actors)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def peer_of(self, actor: str) -> str | None:
        return self.actors.get(actor)

    def stage_peer(self, hop: int) -> str:
        return self.stages[hop]

    def hop_of(self, peer_id: str) -> int | None:
        """The stage `peer_id` runs (the first, should a plan give it two), or None."""
        try:
            return self.stages.index(peer_id)
        except ValueError:
            return None

    def next_peer(self, hop: int) -> str | None:
        """Where stage `hop` sends its output: the next stage, or None for the last."""
        return self.stages[hop + 1] if hop + 1 < len(self.stages) else None


EMPTY = Registry(0, (), (), {})


@dataclass(frozen=True)
class ChainStatus:
    ready: bool
    detail: str  # one line: what the chain waits for, or that it is ready
    cannot_hold: bool = False  # the leader found no plan for the live members: the model does not fit them
    gone: frozenset[str] = frozenset()  # peers the plan names that are dead or no longer members


def chain_status(plan: Mapping[str, Any] | None, members: Sequence[Mapping[str, Any]]) -> ChainStatus:
    """Is every stage of `plan` (its JSON) held by a live member whose assignment is loaded?

    `members` are the rows of `swarmd status` (peer_id, state, assignment{layers, state, error})."""
    if not plan or not plan.get("stages"):
        return ChainStatus(False, "no plan yet (the swarm is still forming)")
    rows = {m["peer_id"]: m for m in members}
    gone, loading, failed, gone_peers = [], [], [], set()
    for i, stage in enumerate(plan["stages"]):
        a, b = stage["layers"]
        what = f"stage {i} (blocks {a}-{b - 1}, {short_id(stage['peer_id'])})"
        m = rows.get(stage["peer_id"])
        if m is None or m.get("state") == "dead":
            gone.append(what)
            gone_peers.add(stage["peer_id"])
            continue
        assignment = m.get("assignment") or {}
        if assignment.get("state") == "failed":
            failed.append(f"{what}: {assignment.get('error') or 'loading failed'}")
        # a spare's warm copy of exactly these blocks is as good as loaded: its next heartbeat says "ready"
        elif assignment.get("state") not in ("ready", "standby") or list(assignment.get("layers") or ()) != [a, b]:
            loading.append(what)
    if failed:
        return ChainStatus(False, "loading failed at " + "; ".join(failed))
    if gone:
        return ChainStatus(False, "waiting for a new plan: " + ", ".join(gone) + " gone", gone=frozenset(gone_peers))
    if loading:
        return ChainStatus(False, f"plan epoch {plan.get('epoch')}: loading " + ", ".join(loading))
    n = len(plan["stages"])
    return ChainStatus(True, f"plan epoch {plan.get('epoch')}: {n} stage{'s' if n != 1 else ''} ready")


def stage_slots(members: Sequence[Mapping[str, Any]]) -> dict[str, StageSlots | None]:
    """Each member's KV slots as its heartbeat reports them (`assignment.kv`; None: it reports none)."""
    out: dict[str, StageSlots | None] = {}
    for m in members:
        kv = (m.get("assignment") or {}).get("kv")
        out[m["peer_id"]] = StageSlots(kv["slots"], kv["used"], kv["version"]) if kv else None
    return out
