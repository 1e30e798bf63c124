"""Simulated fleets: consumer GPU profiles and the compact `--fleet 40x4090,8x3090` form.

Peak figures are the vendors' published specifications (memory, memory bandwidth, dense FP16
tensor throughput with FP32 accumulation, which is what bf16/fp16 matmuls use). GeForce cards
run FP32 accumulation at half their FP16-accumulate tensor rate; professional cards (A4000) and
Apple GPUs do not halve it. What a node achieves is a fraction of peak; the two efficiency
constants below say how much, and every descriptor the fleet builds carries the achieved rates,
like a measured descriptor would.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.errors import PlanSchemaError
from planner.node import NodeDescriptor

GiB = 1024**3

# Achieved / peak. Decode streams weights: llama.cpp decode on an RTX 4090 reaches roughly
# 80-90 % of the 1008 GB/s peak for 4-bit 8 B models; 0.8 is the round, slightly cautious figure.
BANDWIDTH_EFFICIENCY = 0.8
# Large bf16 GEMMs reach 60-80 % of tensor peak in tuned libraries; small-batch decode kernels
# and int4 dequantisation do worse. 0.5 is an assumption, not a measurement.
MATMUL_EFFICIENCY = 0.5
# Memory the driver, display and CUDA context keep on a discrete GPU.
DRIVER_RESERVE_BYTES = GiB // 2
# macOS lets the GPU wire about 75 % of unified memory by default (recommendedMaxWorkingSetSize);
# the rest stays with the system.
APPLE_GPU_MEMORY_FRACTION = 0.75


@dataclass(frozen=True)
class GpuProfile:
    key: str
    label: str
    memory_bytes: int  # as sold
    peak_flops: float  # dense FP16 tensor, FP32 accumulate, FLOP/s
    peak_bandwidth: float  # bytes/s
    source: str

    @property
    def usable_memory(self) -> int:
        if self.key.startswith("m2"):
            return int(self.memory_bytes * APPLE_GPU_MEMORY_FRACTION)
        return self.memory_bytes - DRIVER_RESERVE_BYTES

    @property
    def flops(self) -> float:
        return self.peak_flops * MATMUL_EFFICIENCY

    @property
    def bandwidth(self) -> float:
        return self.peak_bandwidth * BANDWIDTH_EFFICIENCY


GPU_PROFILES: dict[str, GpuProfile] = {
    p.key: p
    for p in (
        GpuProfile("3060", "RTX 3060 12GB", 12 * GiB, 25.6e12, 360e9,
                   "GA106, 192-bit GDDR6 15 Gbps; 51.2 TFLOPS FP16-acc tensor, halved for FP32 acc"),
        GpuProfile("3090", "RTX 3090", 24 * GiB, 71e12, 936e9,
                   "GA102, 384-bit GDDR6X 19.5 Gbps; 142 TFLOPS FP16-acc tensor, halved"),
        GpuProfile("4060ti", "RTX 4060 Ti 16GB", 16 * GiB, 44e12, 288e9,
                   "AD106, 128-bit GDDR6 18 Gbps; 88 TFLOPS FP16-acc tensor, halved"),
        GpuProfile("4090", "RTX 4090", 24 * GiB, 165e12, 1008e9,
                   "AD102, 384-bit GDDR6X 21 Gbps; 330 TFLOPS FP16-acc tensor, halved"),
        GpuProfile("5090", "RTX 5090", 32 * GiB, 209.5e12, 1792e9,
                   "GB202, 512-bit GDDR7 28 Gbps; 419 TFLOPS FP16-acc tensor, halved"),
        GpuProfile("a4000", "RTX A4000", 16 * GiB, 76.7e12, 448e9,
                   "GA104, 256-bit GDDR6 14 Gbps; 153.4 TFLOPS sparse tensor = 76.7 dense, full rate"),
        GpuProfile("m2ultra", "M2 Ultra 192GB", 192 * GiB, 27.2e12, 800e9,
                   "76-core GPU 27.2 TFLOPS (FP16 at the FP32 rate), 800 GB/s unified memory"),
    )
}

_ALIASES = {"rtx": "", "-": "", "_": "", " ": "", "gb": ""}


def profile(name: str) -> GpuProfile:
    """A profile by key or a loose spelling: '4090', 'RTX4090', '4060-ti', 'm2-ultra', '3060-12gb'."""
    key = name.lower()
    for a, b in _ALIASES.items():
        key = key.replace(a, b)
    key = re.sub(r"^(3060)12$", r"\1", key)
    key = re.sub(r"^(4060ti)16$", r"\1", key)
    key = re.sub(r"^(m2ultra)192$", r"\1", key)
    if key not in GPU_PROFILES:
        raise PlanSchemaError(f"unknown GPU {name!r}; known: {', '.join(GPU_PROFILES)}")
    return GPU_PROFILES[key]


def parse_fleet(spec: str) -> list[tuple[int, GpuProfile]]:
    """'40x4090,8x3090,4x3060' -> [(40, 4090), (8, 3090), (4, 3060)]; a bare name counts once."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(?:(\d+)\s*[x*]\s*)?(.+)", part, flags=re.IGNORECASE)
        assert m is not None
        count = int(m.group(1) or 1)
        if count < 1:
            raise PlanSchemaError(f"fleet entry {part!r} needs a count of at least 1")
        out.append((count, profile(m.group(2))))
    if not out:
        raise PlanSchemaError("an empty fleet")
    return out


@dataclass(frozen=True)
class SimulatedFleet:
    nodes: list[NodeDescriptor]  # one per GPU, named r{region}-{gpu}-{serial}
    regions: list[int]  # each node's region
    rtt_ms: np.ndarray  # (regions, regions) round trip; the diagonal is inside a region
    uplink_mbit: float


def make_fleet(
    spec: str,
    *,
    regions: int = 1,
    rtt_ms: tuple[float, float] = (1.0, 50.0),
    uplink_mbit: float = 1000.0,
    region_rtt_ms: Sequence[Sequence[float]] | None = None,
) -> list[NodeDescriptor]:
    """Descriptors for a fleet (see `simulated_fleet`)."""
    return simulated_fleet(spec, regions=regions, rtt_ms=rtt_ms, uplink_mbit=uplink_mbit,
                           region_rtt_ms=region_rtt_ms).nodes


def simulated_fleet(
    spec: str,
    *,
    regions: int = 1,
    rtt_ms: tuple[float, float] = (1.0, 50.0),
    uplink_mbit: float = 1000.0,
    region_rtt_ms: Sequence[Sequence[float]] | None = None,
) -> SimulatedFleet:
    """Descriptors for a fleet, and where each node is. Nodes go to regions round robin in the order the spec
    lists them, so every region gets a mix. RTT is rtt_ms[0] inside a region and rtt_ms[1] between regions, or
    region_rtt_ms[a][b] between regions a and b when given (its diagonal is the intra-region RTT)."""
    if regions < 1:
        raise PlanSchemaError("--regions must be at least 1")
    if uplink_mbit <= 0:
        raise PlanSchemaError("the uplink must be above 0 Mbit/s")
    intra, inter = rtt_ms
    if region_rtt_ms is not None:
        table = np.asarray(region_rtt_ms, dtype=float)
        if table.shape != (regions, regions):
            raise PlanSchemaError(f"the region RTT table must be {regions} x {regions}")
    else:
        table = np.full((regions, regions), float(inter))
        np.fill_diagonal(table, float(intra))
    if (table < 0).any():
        raise PlanSchemaError("round trips cannot be negative")
    entries = []
    serial = 0
    for count, prof in parse_fleet(spec):
        for _ in range(count):
            entries.append((serial % regions, prof, serial))
            serial += 1
    width = len(str(len(entries) - 1))
    ids = [f"r{r}-{prof.key}-{i:0{width}d}" for r, prof, i in entries]
    region = np.array([r for r, _, _ in entries])
    nodes = []
    for i, (r, prof, _) in enumerate(entries):
        rtts = table[r, region]
        nodes.append(NodeDescriptor(
            peer_id=ids[i],
            memory_total=prof.usable_memory,
            memory_free=prof.usable_memory,
            flops=prof.flops,
            mem_bandwidth=prof.bandwidth,
            uplink_bps=uplink_mbit * 1e6,
            rtt_ms={ids[j]: float(rtts[j]) for j in range(len(entries)) if j != i},
            label=prof.label,
        ))
    return SimulatedFleet(nodes, region.tolist(), table, float(uplink_mbit))
