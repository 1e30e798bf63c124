"""This daemon's NodeDescriptor: its device, memory, measured speed and what it serves.

The speed figures come from a short tinygrad micro-benchmark (a float32 matmul for FLOP/s, an
elementwise pass over a large buffer for memory bandwidth) run on the daemon's device at first
start and cached in `$SWARMD_HOME/device-bench.json`, keyed by device, device name and tinygrad
version, so later starts take no time. `--memory-limit` caps the memory reported (one machine can
play a fleet of smaller GPUs) and `--device-label` names the device in status tables.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from planner.node import NodeDescriptor
from swarmd import WIRE_VERSION, __version__
from swarmd.errors import UserError

log = logging.getLogger(__name__)

BENCH_FILE = "device-bench.json"
INCARNATION_FILE = "incarnation"


@dataclass(frozen=True)
class DeviceBench:
    flops: float  # FLOP/s of a float32 matmul
    mem_bandwidth: float  # bytes/s read + written by an elementwise op
    matmul_n: int
    seconds: float  # how long the benchmark took


def resolve_device(requested: str) -> str:
    """'auto' -> tinygrad's default device; otherwise check that tinygrad can open the device."""
    from tinygrad import Device

    if requested.lower() == "auto":
        return Device.DEFAULT
    name = requested.upper()
    try:
        Device[name]
    except Exception as e:
        raise UserError(f"device {requested!r} is not available to tinygrad here: {str(e).splitlines()[0]}") from None
    return Device.canonicalize(name)


def device_name(device: str) -> str:
    """The GPU's or CPU's model name, as well as this machine can tell."""
    base = device.split(":")[0]
    if base in ("CUDA", "NV") and shutil.which("nvidia-smi"):
        out = _run(["nvidia-smi", f"--id={smi_id(device)}", "--query-gpu=name", "--format=csv,noheader"])
        if out:
            return out.splitlines()[0].strip()
    if base in ("CPU", "CLANG", "LLVM"):
        return cpu_name()
    return base


def smi_id(device: str) -> str:
    """nvidia-smi's id of a CUDA device: CUDA numbers only the GPUs CUDA_VISIBLE_DEVICES lists (one
    daemon per GPU sees its GPU as device 0), nvidia-smi numbers them all."""
    index = int(device.split(":")[1]) if ":" in device else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_memory(device: str) -> tuple[int, int]:
    """(total, free) bytes of the device's memory; host RAM for CPU devices."""
    import psutil

    base = device.split(":")[0]
    if base in ("CUDA", "NV") and shutil.which("nvidia-smi"):
        out = _run(["nvidia-smi", f"--id={smi_id(device)}", "--query-gpu=memory.total,memory.free",
                    "--format=csv,noheader,nounits"])
        if out:
            total_mib, free_mib = (int(x) for x in out.splitlines()[0].split(","))
            return total_mib << 20, free_mib << 20
    vm = psutil.virtual_memory()
    return vm.total, vm.available


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def measure_device(device: str, budget_s: float = 2.0) -> DeviceBench:
    """Run the micro-benchmark on `device` (blocking: call it in a worker thread)."""
    from tinygrad import Device, Tensor, dtypes

    t_start = time.perf_counter()
    dev = Device[device]

    def best_of(fn: Callable[[], object], runs: int) -> float:
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            dev.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    # Grow the matmul until one takes long enough to time well (or the budget runs out). A GPU starts
    # at the largest size: at 256 its first compile alone spent the budget on an H200, which then
    # reported launch overhead (11 GFLOP/s) as its speed.
    cpu = device.split(":")[0] in ("CPU", "CLANG", "LLVM")
    n, flops = 256 if cpu else 4096, 0.0
    while True:
        a = Tensor.rand(n, n, dtype=dtypes.float32, device=device).realize()
        b = Tensor.rand(n, n, dtype=dtypes.float32, device=device).realize()
        (a @ b).realize()  # compile
        dt = best_of(functools.partial(_matmul, a, b), 3)
        flops = 2 * n**3 / dt
        if dt > 0.02 or n >= 4096 or time.perf_counter() - t_start > budget_s / 2:
            break
        n *= 2
    m = 16 << 20 if cpu else 64 << 20
    x = Tensor.rand(m, dtype=dtypes.float32, device=device).realize()
    (x * 2).realize()
    dt = best_of(lambda: (x * 2).realize(), 3)
    return DeviceBench(flops=flops, mem_bandwidth=2 * 4 * m / dt, matmul_n=n,
                       seconds=round(time.perf_counter() - t_start, 3))


def _matmul(a, b) -> None:
    (a @ b).realize()


def load_or_measure(home: Path, device: str, name: str) -> DeviceBench:
    """The cached benchmark for this device, measured (and cached) if there is none."""
    import tinygrad

    key = {"device": device, "device_name": name, "tinygrad": getattr(tinygrad, "__version__", "?")}
    path = Path(home) / BENCH_FILE
    try:
        doc = json.loads(path.read_text())
        if {k: doc.get(k) for k in key} == key:
            return DeviceBench(float(doc["flops"]), float(doc["mem_bandwidth"]), int(doc["matmul_n"]),
                               float(doc["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.info("measuring %s (%s): matmul throughput and memory bandwidth, once", device, name)
    bench = measure_device(device)
    log.info("%s: %.1f GFLOP/s, %.1f GB/s (matmul %d, %.1f s; cached in %s)", device, bench.flops / 1e9,
             bench.mem_bandwidth / 1e9, bench.matmul_n, bench.seconds, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**key, "flops": bench.flops, "mem_bandwidth": bench.mem_bandwidth,
                               "matmul_n": bench.matmul_n, "seconds": bench.seconds}, indent=1))
    os.replace(tmp, path)
    return bench


def next_incarnation(home: Path) -> int:
    """1 on the first start, one more on every start after: a restart is told from a stale heartbeat."""
    path = Path(home) / INCARNATION_FILE
    try:
        n = int(path.read_text().strip()) + 1
    except (OSError, ValueError):
        n = 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{n}\n")
    return n


def uplink_bps(configured_mbps: float | None) -> float:
    """The configured uplink, else the fastest non-loopback interface that reports a speed, else 1 Gb/s."""
    if configured_mbps:
        return configured_mbps * 1e6
    best = 0
    for iface in Path("/sys/class/net").glob("*"):
        if iface.name == "lo":
            continue
        try:
            best = max(best, int((iface / "speed").read_text().strip()))
        except (OSError, ValueError):
            continue
    return (best if best > 0 else 1000) * 1e6


@dataclass
class LocalDescriptor:
    """Builds this daemon's NodeDescriptor on demand: static facts plus what changes (memory, load)."""

    peer_id: str
    device: str
    device_name: str
    bench: DeviceBench
    memory_limit: int | None
    label: str
    model_name: str
    model_digest: str
    incarnation: int
    uplink: float
    addresses: Callable[[], list[str]]
    load: Callable[[], float] = field(default=lambda: 0.0)
    holds: Callable[[], tuple[str, ...]] = field(default=lambda: ())  # the weights on disk (planner.holdings)
    standby: bool = False
    slot: str = ""
    memory_refresh_s: float = 5.0
    _memory: tuple[float, int, int] = (float("-inf"), 0, 0)
    _host_ram: int = 0  # read once: it does not change while the daemon runs
    addresses_refresh_s: float = 1.0
    _addresses: tuple[float, tuple[str, ...]] = (float("-inf"), ())
    links: Callable[[], dict[str, str]] = field(default=dict)  # peer -> "data-plane" | "direct" | "relayed"

    def memory(self) -> tuple[int, int]:
        now = time.monotonic()
        if now - self._memory[0] > self.memory_refresh_s:
            total, free = device_memory(self.device)
            self._memory = (now, total, free)
        _, total, free = self._memory
        if self.memory_limit is not None:
            return self.memory_limit, min(self.memory_limit, free)
        return total, free

    def listen_addresses(self) -> tuple[str, ...]:
        """The host's addresses, asked again at most once a second (libp2p asks every listening socket)."""
        now = time.monotonic()
        if not self._addresses[1] or now - self._addresses[0] > self.addresses_refresh_s:
            self._addresses = (now, tuple(self.addresses()))
        return self._addresses[1]

    def host_ram(self) -> int:
        if not self._host_ram:
            import psutil

            self._host_ram = psutil.virtual_memory().total
        return self._host_ram

    def __call__(self) -> NodeDescriptor:
        total, free = self.memory()
        return NodeDescriptor(
            peer_id=self.peer_id,
            memory_total=total,
            memory_free=free,
            flops=self.bench.flops,
            mem_bandwidth=self.bench.mem_bandwidth,
            uplink_bps=self.uplink,
            addresses=self.listen_addresses(),
            swarmd_version=__version__,
            wire_version=WIRE_VERSION,
            label=self.label or self.device_name,
            device=self.device,
            device_name=self.device_name,
            host_ram=self.host_ram(),
            model_name=self.model_name,
            model_digest=self.model_digest,
            load=float(self.load()),
            incarnation=self.incarnation,
            standby=self.standby,
            slot=self.slot,
            holds=self.holds(),
            links=dict(self.links()),
        )
