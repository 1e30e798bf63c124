"""PlanOptions: what the planner assumes beyond the layout and the nodes.

Every constant of the cost model lives here, with where it comes from, so a plan can be
reproduced from (layout, nodes, options) alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.errors import PlanSchemaError

MiB = 1024**2
GiB = 1024**3


@dataclass(frozen=True)
class PlanOptions:
    # --- memory -------------------------------------------------------------------------
    context_length: int = 2048  # KV budget per request, in tokens
    concurrency: int = 4  # requests whose KV must fit at once; also the load the prediction assumes
    runtime_overhead_bytes: int = 256 * MiB  # per node: runtime, compiled kernels, activation buffers
    # --- network ------------------------------------------------------------------------
    # Software cost of one message (framing, encryption, Python): py-libp2p 0.8.1's on loopback is in
    # docs/BENCHMARKS.md, "Per-hop latency" (the transport on libp2p).
    hop_overhead_ms: float = 1.0
    default_rtt_ms: float = 1.0  # a pair with no measurement in either direction
    # Nodes closer than this form one low-latency group (or closer than 1.5 x the median
    # nearest-neighbour RTT, when that is larger: see planner.topology.group_threshold).
    group_rtt_ms: float = 10.0
    # --- prediction -----------------------------------------------------------------------
    # Decode reads the KV of the tokens so far; the prediction takes the middle of the budget.
    decode_context_fraction: float = 0.5
    # --- experts ----------------------------------------------------------------------------
    # "auto": spread under the balanced policy, under min-latency both tried and the better plan kept;
    # "local" keeps every block's experts on its stage's node; "spread" puts them on the other nodes
    # of the stage's group too.
    expert_placement: str = "auto"
    # block -> load per routed expert (token counts or fractions); missing blocks are uniform.
    expert_load: Mapping[int, Sequence[float]] = field(default_factory=dict)
    hot_expert_factor: float = 2.0  # an expert with load >= factor x mean is hot
    max_replicas: int = 4  # copies of one hot expert, the original included
    replica_memory_fraction: float = 0.5  # share of a node's spare memory replicas may take
    # --- weights ----------------------------------------------------------------------------
    # A node that lacks weights of its assignment fetches them from holders, each serving at most this rate
    # (the daemons' `weights_serve_mbps`); then loads what it holds at `load_bytes_per_s` (measured in
    # docs/BENCHMARKS.md, "Weights through the swarm").
    fetch_bytes_per_s: float = 25e6
    load_bytes_per_s: float = 100e6
    # --- re-planning ----------------------------------------------------------------------
    # Surviving nodes keep their assignments when that plan's score is within this fraction of
    # the best fresh plan: reloading weights costs minutes, a few percent of speed does not.
    replan_tolerance: float = 0.10

    def __post_init__(self) -> None:
        if self.context_length < 1 or self.concurrency < 1:
            raise PlanSchemaError("context_length and concurrency must be at least 1")
        if self.fetch_bytes_per_s <= 0 or self.load_bytes_per_s <= 0:
            raise PlanSchemaError("fetch_bytes_per_s and load_bytes_per_s must be positive")
        if self.runtime_overhead_bytes < 0 or self.hop_overhead_ms < 0 or self.replan_tolerance < 0:
            raise PlanSchemaError("overheads and tolerances cannot be negative")
        if self.expert_placement not in ("auto", "local", "spread"):
            raise PlanSchemaError(f"expert_placement must be auto, local or spread, not {self.expert_placement!r}")
        if self.max_replicas < 1:
            raise PlanSchemaError("max_replicas counts the original: at least 1")

    @property
    def decode_context(self) -> int:
        return max(1, int(self.context_length * self.decode_context_fraction))

    def load_of(self, block: int, n_experts: int) -> list[float] | None:
        """Relative load per expert of `block` (mean 1.0), or None when unknown or uniform."""
        raw = self.expert_load.get(block)
        if raw is None:
            return None
        if len(raw) != n_experts or any(x < 0 for x in raw):
            raise PlanSchemaError(f"expert_load for block {block} needs {n_experts} non-negative values")
        total = float(sum(raw))
        if total <= 0:
            return None
        return [x * n_experts / total for x in raw]

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {k: getattr(self, k) for k in self.__dataclass_fields__}
        doc["expert_load"] = {str(b): list(v) for b, v in sorted(self.expert_load.items())}
        return doc

    @staticmethod
    def from_json(doc: Any) -> PlanOptions:
        if not isinstance(doc, dict):
            raise PlanSchemaError("plan options must be a JSON object")
        unknown = set(doc) - set(PlanOptions.__dataclass_fields__)
        if unknown:
            raise PlanSchemaError(f"unknown plan options: {', '.join(sorted(unknown))}")
        try:
            d = dict(doc)
            if "expert_load" in d:
                d["expert_load"] = {int(b): tuple(float(x) for x in v) for b, v in d["expert_load"].items()}
            return PlanOptions(**d)
        except (TypeError, ValueError) as e:
            raise PlanSchemaError(f"bad plan options: {e}") from e
