"""NodeDescriptor: one daemon's hardware and state, as gossiped and as planned over.

The same schema is published by every daemon in its heartbeat and read by the planner. Fields the
planner does not use (addresses, versions, load) still live here so there is one schema, not two.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from planner.errors import PlanSchemaError
from planner.holdings import parse_holdings


@dataclass(frozen=True)
class NodeDescriptor:
    peer_id: str
    memory_total: int  # bytes usable for weights + KV + runtime (honours --memory-limit)
    memory_free: int
    flops: float = 1e12  # measured matmul throughput, FLOP/s
    mem_bandwidth: float = 100e9  # measured memory bandwidth, bytes/s
    uplink_bps: float = 1e9  # estimated uplink, bits/s
    rtt_ms: dict[str, float] = field(default_factory=dict)  # peer id -> measured round trip
    # identity and software
    addresses: tuple[str, ...] = ()
    swarmd_version: str = ""
    wire_version: int = 0
    label: str = ""  # e.g. "RTX 3060 12GB" when one machine plays a fleet
    device: str = ""  # tinygrad device, e.g. "CPU", "CUDA"
    device_name: str = ""  # GPU/CPU model name
    host_ram: int = 0
    model_name: str = ""
    model_digest: str = ""
    load: float = 0.0  # requests in flight
    incarnation: int = 0  # bumped on every restart, so a rejoin is told from a stale heartbeat
    standby: bool = False  # a spare (`swarmd join --standby`): holds a warm copy of a stage, serves when one is lost
    slot: str = ""  # the plan file's slot this daemon claims (`swarmd join --plan FILE --slot NAME`)
    holds: tuple[str, ...] = ()  # the weights on its disk (`planner.holdings`); ("*",): all of them
    # peer id -> how activations reach it: "data-plane", "direct" or "relayed" (through a third daemon: the planner
    # prices such a hop as two)
    links: dict[str, str] = field(default_factory=dict)

    def relayed_to(self, other: str) -> bool:
        return self.links.get(other) == "relayed"

    def rtt_to(self, other: str, default_ms: float = 1.0) -> float:
        return self.rtt_ms.get(other, default_ms)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["addresses"] = list(self.addresses)
        doc["holds"] = list(self.holds)
        if not self.links:  # left out when empty: descriptors of daemons without it read the same
            doc.pop("links")
        return doc

    @staticmethod
    def from_json(doc: dict[str, Any]) -> NodeDescriptor:
        if not isinstance(doc, dict):
            raise PlanSchemaError("a NodeDescriptor must be a JSON object")
        known = {f.name for f in fields(NodeDescriptor)}
        unknown = set(doc) - known
        if unknown:
            raise PlanSchemaError(f"unknown NodeDescriptor fields: {', '.join(sorted(unknown))}")
        d = dict(doc)
        for key in ("addresses", "holds"):
            if key in d and isinstance(d[key], list):
                d[key] = tuple(d[key])
        for f in fields(NodeDescriptor):  # descriptors come from peers: every field has the type it says
            if f.name in d and not _has_type(d[f.name], str(f.type)):
                raise PlanSchemaError(f"NodeDescriptor field {f.name!r} must be {f.type}, not {type(d[f.name]).__name__}")
        try:
            d["rtt_ms"] = {str(k): float(v) for k, v in d.get("rtt_ms", {}).items()}
            node = NodeDescriptor(**d)
        except (TypeError, ValueError) as e:
            raise PlanSchemaError(f"bad NodeDescriptor: {e}") from e
        if not node.peer_id or node.memory_total < 0 or node.memory_free < 0:
            raise PlanSchemaError("a NodeDescriptor needs a peer_id and non-negative memory")
        parse_holdings(node.holds)  # PlanSchemaError if a peer sent something else
        return node


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _has_type(value: Any, annotation: str) -> bool:
    if annotation == "bool":
        return isinstance(value, bool)
    if annotation == "str":
        return isinstance(value, str)
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation == "float":
        return _number(value)
    if annotation == "tuple[str, ...]":
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if annotation == "dict[str, float]":
        return isinstance(value, dict) and all(isinstance(k, str) and _number(v) for k, v in value.items())
    if annotation == "dict[str, str]":
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    raise TypeError(f"no check for NodeDescriptor fields of type {annotation}")  # a new field needs one
