"""The Plan: which node runs which blocks and which experts. Versioned JSON, the same everywhere.

    {"version": 1, "epoch": 3, "policy": "balanced",
     "model": {"name": ..., "digest": ..., "dtype": ...},
     "head": "<peer id holding the output head>",
     "stages": [{"peer_id": ..., "layers": [0, 10], "actors": ["stage-0", "moe-router-3"]}, ...],
     "experts": {"3": {"0": ["<peer id>", ...], ...}},
     "standbys": [{"peer_id": ..., "layers": [10, 20]}, ...],
     "predicted": {"token_latency_ms": ..., "stream_tokens_per_s": ..., "aggregate_tokens_per_s": ...,
                   "saturated_tokens_per_s": ..., "bottleneck": "...", "fetch_bytes": ..., "ready_s": ...},
     "reasons": ["...", ...]}

`layers` are [start, end) over block indices; the embedding travels with the first stage and the
output head with the last. `experts` maps an MoE block to each routed expert's holders, nearest to
the block's stage first: a router sends to the first live one. `standbys` are spare nodes, each holding a
loaded copy of one stage's blocks (the same [start, end)) but no stage: if that stage's node is lost, the
repaired plan puts the spare in its place and nothing has to load. `aggregate_tokens_per_s` is what the
configured number of concurrent streams would get; `saturated_tokens_per_s` what enough streams to
keep the busiest node busy would get (no batching assumed in either).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from planner.errors import PlanSchemaError

PLAN_VERSION = 1


def stage_actor(index: int) -> str:
    return f"stage-{index}"


def router_actor(block: int) -> str:
    return f"moe-router-{block}"


def expert_actor(block: int, expert: int) -> str:
    return f"moe-expert-{block}-{expert}"


@dataclass(frozen=True)
class ModelRef:
    name: str
    digest: str = ""
    dtype: str = ""


@dataclass(frozen=True)
class Stage:
    peer_id: str
    layers: tuple[int, int]  # [start, end) over block indices
    actors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prediction:
    token_latency_ms: float = 0.0
    stream_tokens_per_s: float = 0.0
    aggregate_tokens_per_s: float = 0.0
    bottleneck: str = ""
    saturated_tokens_per_s: float = 0.0
    fetch_bytes: int = 0  # weights the plan's nodes must fetch from others before it serves
    ready_s: float = 0.0  # seconds until every node is ready: its fetch, then its load


@dataclass(frozen=True)
class Plan:
    epoch: int
    model: ModelRef
    stages: tuple[Stage, ...]
    experts: dict[int, dict[int, tuple[str, ...]]] = field(default_factory=dict)
    standbys: dict[str, tuple[int, int]] = field(default_factory=dict)  # spare peer -> the blocks it holds a copy of
    predicted: Prediction = Prediction()
    reasons: tuple[str, ...] = ()
    policy: str = "balanced"
    version: int = PLAN_VERSION

    @property
    def head(self) -> str:
        """The peer holding the output norm and LM head: the last stage's."""
        return self.stages[-1].peer_id if self.stages else ""

    @property
    def n_blocks(self) -> int:
        return self.stages[-1].layers[1] if self.stages else 0

    def peers(self) -> list[str]:
        """Every peer with an assignment, stages first in chain order, then expert-only nodes."""
        seen: dict[str, None] = {s.peer_id: None for s in self.stages}
        for by_expert in self.experts.values():
            for peers in by_expert.values():
                seen.update(dict.fromkeys(peers))
        return list(seen)

    def stage_of_block(self, block: int) -> int:
        for i, s in enumerate(self.stages):
            if s.layers[0] <= block < s.layers[1]:
                return i
        raise KeyError(f"block {block} is in no stage")

    def experts_on(self, peer_id: str) -> dict[int, list[int]]:
        """block -> expert indices that `peer_id` serves."""
        out: dict[int, list[int]] = {}
        for block, by_expert in self.experts.items():
            mine = [e for e, peers in by_expert.items() if peer_id in peers]
            if mine:
                out[block] = sorted(mine)
        return out

    def with_epoch(self, epoch: int) -> Plan:
        return replace(self, epoch=epoch)

    # --- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "epoch": self.epoch,
            "policy": self.policy,
            "model": {"name": self.model.name, "digest": self.model.digest, "dtype": self.model.dtype},
            "head": self.head,
            "stages": [
                {"peer_id": s.peer_id, "layers": [s.layers[0], s.layers[1]], "actors": list(s.actors)}
                for s in self.stages
            ],
            "experts": {
                str(b): {str(e): list(peers) for e, peers in sorted(by_e.items())}
                for b, by_e in sorted(self.experts.items())
            },
            "standbys": [{"peer_id": p, "layers": [a, b]} for p, (a, b) in sorted(self.standbys.items())],
            "predicted": {
                "token_latency_ms": self.predicted.token_latency_ms,
                "stream_tokens_per_s": self.predicted.stream_tokens_per_s,
                "aggregate_tokens_per_s": self.predicted.aggregate_tokens_per_s,
                "saturated_tokens_per_s": self.predicted.saturated_tokens_per_s,
                "bottleneck": self.predicted.bottleneck,
                "fetch_bytes": self.predicted.fetch_bytes,
                "ready_s": self.predicted.ready_s,
            },
            "reasons": list(self.reasons),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @staticmethod
    def from_json(doc: Any) -> Plan:
        if not isinstance(doc, dict):
            raise PlanSchemaError("a Plan must be a JSON object")
        if doc.get("version") != PLAN_VERSION:
            raise PlanSchemaError(f"unsupported Plan version {doc.get('version')!r} (this swarmd reads {PLAN_VERSION})")
        try:
            stages = tuple(
                Stage(peer_id=str(s["peer_id"]), layers=(int(s["layers"][0]), int(s["layers"][1])),
                      actors=tuple(str(a) for a in s.get("actors", ())))
                for s in doc["stages"]
            )
            experts = {
                int(b): {int(e): tuple(str(p) for p in peers) for e, peers in by_e.items()}
                for b, by_e in doc.get("experts", {}).items()
            }
            standbys = {str(s["peer_id"]): (int(s["layers"][0]), int(s["layers"][1]))
                        for s in doc.get("standbys", ())}
            m = doc["model"]
            p = doc.get("predicted", {})
            plan = Plan(
                epoch=int(doc["epoch"]),
                model=ModelRef(str(m["name"]), str(m.get("digest", "")), str(m.get("dtype", ""))),
                stages=stages,
                experts=experts,
                standbys=standbys,
                predicted=Prediction(
                    float(p.get("token_latency_ms", 0.0)), float(p.get("stream_tokens_per_s", 0.0)),
                    float(p.get("aggregate_tokens_per_s", 0.0)), str(p.get("bottleneck", "")),
                    float(p.get("saturated_tokens_per_s", 0.0)), int(p.get("fetch_bytes", 0)),
                    float(p.get("ready_s", 0.0)),
                ),
                reasons=tuple(str(r) for r in doc.get("reasons", ())),
                policy=str(doc.get("policy", "balanced")),
            )
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            raise PlanSchemaError(f"bad Plan document: {type(e).__name__}: {e}") from e
        validate_chain(plan)
        validate_standbys(plan)
        if "head" in doc and plan.stages and doc["head"] != plan.head:
            raise PlanSchemaError("Plan 'head' must be the last stage's peer")
        return plan

    @staticmethod
    def loads(text: str) -> Plan:
        try:
            return Plan.from_json(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanSchemaError(f"a Plan must be JSON: {e}") from e


def validate_chain(plan: Plan, n_blocks: int | None = None) -> None:
    """Every block exactly once, contiguous and in order, starting at 0 (and ending at n_blocks)."""
    if not plan.stages:
        raise PlanSchemaError("a Plan needs at least one stage")
    expect = 0
    for i, s in enumerate(plan.stages):
        a, b = s.layers
        if a != expect or b <= a:
            raise PlanSchemaError(f"stage {i} covers blocks [{a}, {b}), expected to start at {expect}")
        expect = b
    if n_blocks is not None and expect != n_blocks:
        raise PlanSchemaError(f"the stages cover blocks 0-{expect - 1} of a model with {n_blocks}")


def validate_standbys(plan: Plan) -> None:
    """Every standby copy is the block range of one stage, held by a peer that has no stage."""
    ranges = {s.layers for s in plan.stages}
    holders = {s.peer_id for s in plan.stages}
    for peer, layers in plan.standbys.items():
        if peer in holders:
            raise PlanSchemaError(f"standby {peer} also runs a stage")
        if layers not in ranges:
            raise PlanSchemaError(f"standby {peer} holds blocks [{layers[0]}, {layers[1]}), which is no stage's range")
