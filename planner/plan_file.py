"""A plan file: a Plan for a fleet whose nodes are slots, plus the fleet itself. Pure (no I/O).

`swarmd plan --fleet ... --out FILE` writes one; `swarmd join --plan FILE --slot NAME` claims a slot of it on a
real machine, and `swarmd cluster up --plan FILE` brings the whole fleet up on this one. The document is the
Plan JSON (`planner.plan`) with slot names wherever peer ids go, and one more top-level key:

    "fleet": {"slots": {"r0-4090-0": {"device": "RTX 4090", "memory": 25232932864, "region": 0}, ...},
              "regions": {"rtt_ms": [[1.0, 60.0], [60.0, 1.0]], "uplink_mbit": 100.0}}

`rtt_ms[a][b]` is the round trip between a slot of region a and one of region b (the diagonal: inside a region);
every slot's uplink is `uplink_mbit`. Once daemons have claimed the slots, `bind` turns the slot plan into the
plan the swarm runs, with their peer ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from planner.errors import PlanSchemaError
from planner.plan import Plan


@dataclass(frozen=True)
class Slot:
    name: str
    device: str  # the device label its daemon shows (`swarmd join --device-label`)
    memory: int  # bytes its daemon may use (`--memory-limit`)
    region: int


@dataclass(frozen=True)
class Fleet:
    slots: tuple[Slot, ...]
    rtt_ms: tuple[tuple[float, ...], ...]  # region x region round trip, ms; the diagonal is inside a region
    uplink_mbit: float  # every slot's uplink

    @property
    def regions(self) -> int:
        return len(self.rtt_ms)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)

    def slot(self, name: str) -> Slot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(name)

    def rtt_between(self, a: str, b: str) -> float:
        return self.rtt_ms[self.slot(a).region][self.slot(b).region]

    def to_json(self) -> dict[str, Any]:
        return {
            "slots": {s.name: {"device": s.device, "memory": s.memory, "region": s.region} for s in self.slots},
            "regions": {"rtt_ms": [list(row) for row in self.rtt_ms], "uplink_mbit": self.uplink_mbit},
        }

    @staticmethod
    def from_json(doc: Any) -> Fleet:
        try:
            regions = doc["regions"]
            rtt = tuple(tuple(_number(x, "fleet.regions.rtt_ms") for x in row) for row in regions["rtt_ms"])
            uplink = _number(regions["uplink_mbit"], "fleet.regions.uplink_mbit")
            slots = tuple(Slot(str(name), str(s["device"]), int(s["memory"]), int(s["region"]))
                          for name, s in doc["slots"].items())
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanSchemaError(f"bad fleet in the plan file: {type(e).__name__}: {e}") from None
        if not rtt or any(len(row) != len(rtt) for row in rtt):
            raise PlanSchemaError("fleet.regions.rtt_ms must be a square table, one row per region")
        if uplink <= 0:
            raise PlanSchemaError("fleet.regions.uplink_mbit must be above 0")
        if not slots:
            raise PlanSchemaError("the fleet has no slots")
        for s in slots:
            if not s.name or s.memory <= 0 or not 0 <= s.region < len(rtt):
                raise PlanSchemaError(f"slot {s.name!r} needs a name, memory above 0 and a region from 0 to "
                                      f"{len(rtt) - 1}")
        return Fleet(slots, rtt, uplink)


@dataclass(frozen=True)
class PlanFile:
    plan: Plan  # slot names where peer ids go
    fleet: Fleet

    def to_json(self) -> dict[str, Any]:
        return {**self.plan.to_json(), "fleet": self.fleet.to_json()}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @staticmethod
    def from_json(doc: Any) -> PlanFile:
        if not isinstance(doc, dict) or "fleet" not in doc:
            raise PlanSchemaError("a plan file needs a 'fleet' (write one with `swarmd plan --fleet ... --out FILE`)")
        pf = PlanFile(Plan.from_json(doc), Fleet.from_json(doc["fleet"]))
        unknown = sorted(set(pf.plan.peers()) - set(pf.fleet.names))
        if unknown:
            raise PlanSchemaError(f"the plan names {', '.join(unknown[:4])}, which the fleet has no slot for")
        return pf

    @staticmethod
    def loads(text: str) -> PlanFile:
        try:
            return PlanFile.from_json(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanSchemaError(f"a plan file must be JSON: {e}") from None

    def bind(self, peers: Mapping[str, str]) -> Plan:
        """The plan with each slot replaced by the peer id that claimed it (`peers`: slot -> peer id)."""
        missing = [s for s in self.plan.peers() if s not in peers]
        if missing:
            raise PlanSchemaError(f"slots without a peer: {', '.join(missing)}")
        p = self.plan
        return replace(
            p,
            stages=tuple(replace(s, peer_id=peers[s.peer_id]) for s in p.stages),
            experts={b: {e: tuple(peers[h] for h in hs) for e, hs in by.items()} for b, by in p.experts.items()},
            standbys={peers.get(s, s): layers for s, layers in p.standbys.items()},
        )


def fleet_of(names: Sequence[str], devices: Sequence[str], memory: Sequence[int], regions: Sequence[int],
             rtt_ms: Sequence[Sequence[float]], uplink_mbit: float) -> Fleet:
    """A Fleet from parallel lists, one entry per slot (as `planner.fleet.simulated_fleet` gives them)."""
    slots = tuple(Slot(n, d, int(m), int(r)) for n, d, m, r in zip(names, devices, memory, regions, strict=True))
    return Fleet(slots, tuple(tuple(float(x) for x in row) for row in rtt_ms), float(uplink_mbit))


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must hold non-negative numbers")
    return float(value)
