"""NodeDescriptor: one daemon's hardware and state, as gossiped and as planned over.

The same schema is published by every daemon in its heartbeat and read by the planner. Fields the
planner does not use (addresses, versions, load) still live here so there is one schema, not two.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from planner.errors import PlanSchemaError


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

    def rtt_to(self, other: str, default_ms: float = 1.0) -> float:
        return self.rtt_ms.get(other, default_ms)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["addresses"] = list(self.addresses)
        return doc

    @staticmethod
    def from_json(doc: dict[str, Any]) -> NodeDescriptor:
        if not isinstance(doc, dict):
            raise PlanSchemaError("a NodeDescriptor must be a JSON object")
        known = {f.name for f in fields(NodeDescriptor)}
        unknown = set(doc) - known
        if unknown:
            raise PlanSchemaError(f"unknown NodeDescriptor fields: {', '.join(sorted(unknown))}")
        try:
            d = dict(doc)
            d["addresses"] = tuple(d.get("addresses", ()))
            d["rtt_ms"] = {str(k): float(v) for k, v in d.get("rtt_ms", {}).items()}
            node = NodeDescriptor(**d)
        except (TypeError, ValueError) as e:
            raise PlanSchemaError(f"bad NodeDescriptor: {e}") from e
        if not node.peer_id or node.memory_total < 0 or node.memory_free < 0:
            raise PlanSchemaError("a NodeDescriptor needs a peer_id and non-negative memory")
        return node
