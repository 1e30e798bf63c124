"""How many KV slots each stage has free, as one head sees it. Sans-IO.

Every stage gossips its slots in its heartbeat (`AssignmentStatus.kv`): how many requests it holds at most,
how many it holds or has waiting now, and a version that changes with every admission or release there.
Other heads send to the same stages, so a head's view is that report plus what it started and ended there
since that version; it never counts fewer requests on a stage than its own. A stage that answered `busy`
counts as full until its next version, until one of this head's requests there ends, or for `FULL_HOLD`
seconds at most. A view can still be off by another head's requests of the last
heartbeat: a stage then holds a new request until a slot frees (`swarmd.inference.stage.book`), or, when
too many wait there, answers `busy` and the head puts the request back at the front of its queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

FULL_HOLD = 1.0  # s a stage that answered busy counts as full, unless it says otherwise sooner


@dataclass(frozen=True)
class StageSlots:
    """One stage's report: `total` slots, `used` (held or waiting there), `version` (changes with `used`)."""

    total: int
    used: int
    version: int


@dataclass
class _Stage:
    report: StageSlots | None = None
    started: int = 0  # this head's requests sent there since the report's version
    ended: int = 0  # and ended there since
    mine: int = 0  # this head's requests there now
    full_until: float = float("-inf")  # answered busy: full until then (or its next version)


@dataclass
class SlotView:
    stages: dict[str, _Stage] = field(default_factory=dict)

    def report(self, reports: Mapping[str, StageSlots | None]) -> None:
        """The latest gossiped reports, by peer (None: the stage says nothing of its slots)."""
        for peer, slots in reports.items():
            st = self.stages.setdefault(peer, _Stage())
            if slots is None or st.report is None or slots.version != st.report.version:
                st.started = st.ended = 0
                st.full_until = float("-inf")
            st.report = slots

    def started(self, peers: Iterable[str]) -> None:
        for peer in set(peers):
            st = self.stages.setdefault(peer, _Stage())
            st.started += 1
            st.mine += 1

    def ended(self, peers: Iterable[str]) -> None:
        for peer in set(peers):
            st = self.stages.setdefault(peer, _Stage())
            st.ended += 1
            st.mine = max(0, st.mine - 1)
            st.full_until = float("-inf")

    def refused(self, peer: str, now: float) -> None:
        """`peer` answered busy: no room there until it says otherwise (at most `FULL_HOLD` s)."""
        self.stages.setdefault(peer, _Stage()).full_until = now + FULL_HOLD

    def used(self, peer: str) -> int | None:
        st = self.stages.get(peer)
        if st is None or st.report is None:
            return None
        return max(st.report.used + st.started - st.ended, st.mine, 0)

    def free(self, peer: str, now: float) -> int | None:
        """Slots free on `peer` as far as this head knows; None when the stage reports none (no limit known)."""
        st = self.stages.get(peer)
        if st is None:
            return None
        if now < st.full_until:
            return 0
        if st.report is None:
            return None
        used = self.used(peer)
        assert used is not None
        return max(0, st.report.total - used)

    def can_start(self, peers: Iterable[str], now: float) -> bool:
        """Whether a request fits on every one of these stages now."""
        return all((free := self.free(p, now)) is None or free > 0 for p in peers)

    def total(self, peer: str) -> int | None:
        st = self.stages.get(peer)
        return None if st is None or st.report is None else st.report.total
