"""Captured tinygrad graphs kept on disk, so that a new process replays a graph instead of capturing it.

Capturing a `TinyJit` (scheduling its graph, lowering and memory-planning it) costs seconds of Python per
graph on a small CPU, paid by every process for every graph it runs. tinygrad 0.13 can pickle a captured jit
(`TinyJit.__reduce__`), but as it stands the pickle holds a copy of every buffer the graph touches, weights
included, and loads them back as new buffers. Here an entry holds the graph without its owner's data:

* buffers the owner holds (weights, KV cache, tables), given as `bindings` (name -> BUFFER uop), are stored
  by name and bound on load to the same names of the loading owner: the graph computes on its buffers, with
  no second copy. A name it lacks, or one of another size or dtype, makes the entry stale;
* buffers that only the graph writes (its planned intermediates and outputs) are stored as their size and
  made afresh on load, unallocated until the first replay; any other buffer makes a graph uncacheable;
* each program keeps its binary and launch information, not the kernel's AST and instruction list that built
  it; so tinygrad's op and memory counters count loaded graphs as free (they only feed its statistics), and
  a loaded graph's first replay skips summing those symbolic estimates, which cost more than the replay.

An entry is one file, named by the hash of its key (everything that makes the graph valid, given by the
caller; `environment()` is what tinygrad and the machine add), holding a JSON header (the key, a label for
people, the payload's size and sha256) and the pickled graph. A file that does not read back whole, or
whose key or checksum differs, is deleted and reported as missing; so is one whose bindings do not fit.
Files are written whole under a temporary name and renamed, so processes share a directory safely. The
directory is bounded: after each store the least recently used entries (by mtime, renewed on each load)
go until the total fits.

Unpickling runs code named in the file: the directory must be as trusted as tinygrad's own kernel cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import platform
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.engine.jit import CapturedJit
    from tinygrad.uop.ops import UOp

log = logging.getLogger("models.graph_cache")

MAGIC = b"swarmd-graph 1\n"
SUFFIX = ".graph"
DEFAULT_MAX_BYTES = 2 << 30
ENV_DIR = "SWARMD_GRAPH_CACHE"  # a directory, or "off"
ENV_MAX_MB = "SWARMD_GRAPH_CACHE_MB"
OFF = ("off", "0", "none", "false", "no")
_switched_off: contextvars.ContextVar[bool] = contextvars.ContextVar("graph cache switched off", default=False)


class Uncacheable(Exception):
    """The graph reads a buffer that is neither bound nor its own: storing it would copy that buffer."""


class Stale(Exception):
    """An entry's bindings do not fit the owner that loads it."""


@dataclass(frozen=True)
class Entry:
    """One stored graph, as `swarmd models --cache` lists it."""

    path: Path
    size: int
    last_used: float  # seconds since the epoch
    label: dict[str, Any]


def default_directory() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "swarmd" / "graphs"


@contextlib.contextmanager
def switched_off() -> Iterator[None]:
    """Inside (this thread and context), `default_cache()` is None: owners made here capture every graph
    and keep none. For runs that must not depend on what earlier processes left on disk (a simulation's)."""
    token = _switched_off.set(True)
    try:
        yield
    finally:
        _switched_off.reset(token)


def default_cache() -> GraphCache | None:
    """The cache `$SWARMD_GRAPH_CACHE` names (default `~/.cache/swarmd/graphs`; "off": none), bounded by
    `$SWARMD_GRAPH_CACHE_MB` (default 2048). None also when tinygrad's JIT is off (nothing is captured), and
    inside `switched_off()`."""
    from tinygrad.helpers import JIT

    setting = os.environ.get(ENV_DIR, "").strip()
    if setting.lower() in OFF or not JIT.value or _switched_off.get():
        return None
    try:
        max_bytes = int(float(os.environ.get(ENV_MAX_MB, "")) * 2**20)
    except ValueError:
        max_bytes = DEFAULT_MAX_BYTES
    return GraphCache(Path(setting).expanduser() if setting else default_directory(), max_bytes)


def environment(device: str) -> dict[str, Any]:
    """What besides the caller's key decides a graph: tinygrad's version and the settings that change its
    kernels or graphs, and the machine the binaries were built for (CPU features and thread count, or the
    accelerator's compile target)."""
    from importlib.metadata import version

    import tinygrad.codegen as codegen
    from tinygrad import Device
    from tinygrad.helpers import BEAM, CPU_COUNT, JIT, JIT_BATCH_SIZE, getenv

    renderer = Device[device].renderer
    settings = {x.key: x.value for x in (codegen.NOOPT, codegen.EMULATED_DTYPES, codegen.NOLOCALS, codegen.USE_TC,
                                         codegen.IMAGE, codegen.DISABLE_FAST_IDIV, codegen.TRANSCENDENTAL,
                                         codegen.ALLOW_TF32, BEAM, JIT, JIT_BATCH_SIZE)}
    env = {"tinygrad": version("tinygrad"), "settings": settings, "jitbeam": getenv("JITBEAM", BEAM.value),
           "device": device, "renderer": f"{type(renderer).__qualname__} {renderer.target!r}",
           "float4": getattr(renderer, "supports_float4", None), "machine": platform.machine()}
    if device.split(":")[0] == "CPU":
        env |= {"cpu": _cpu_identity(), "threads": CPU_COUNT.value}
    return env


@functools.cache
def _cpu_identity() -> str:
    """The CPU's model and feature flags (the binaries are compiled for this very CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return hashlib.sha256("\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted})).encode()).hexdigest()


def named_buffers(parts: Iterable[tuple[str, Tensor]]) -> dict[str, UOp]:
    """Name every device buffer behind `parts` (name -> tensor, e.g. a state dict): `name#k` is the k-th
    buffer of that tensor's graph. Names are given in sorted order, so a buffer shared by several tensors
    (a fused matrix and its views, a tied head) is named after the first of them whatever the order given."""
    from tinygrad.uop.ops import Ops

    names: dict[UOp, str] = {}
    for name, t in sorted(parts, key=lambda p: p[0]):
        for k, u in enumerate(u for u in t.uop.toposort() if u.op is Ops.BUFFER):
            names.setdefault(u, f"{name}#{k}")
    return {n: u for u, n in names.items()}


def signature(bindings: Mapping[str, UOp]) -> str:
    """A hash of the bindings' names, dtypes and sizes: owners with equal signatures bind alike."""
    rows = sorted(f"{n} {u.dtype} {u.arg} {u.device}" for n, u in bindings.items())
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


class GraphCache:
    """A directory of captured graphs, bounded to `max_bytes`."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    def path_of(self, key: Mapping[str, Any]) -> Path:
        return self.root / f"{_digest(key)[:40]}{SUFFIX}"

    def has(self, key: Mapping[str, Any]) -> bool:
        return self.path_of(key).is_file()

    def load(self, key: Mapping[str, Any], bindings: Mapping[str, UOp]) -> CapturedJit | None:
        """The graph stored under `key`, bound to `bindings`; None when there is none, or when the entry is
        corrupt or stale (then it is deleted: the caller captures the graph again and stores it)."""
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                header, payload = _read(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            return self._drop(path, f"unreadable ({e})")
        if header.get("key") != json.loads(_canonical(key)):
            return self._drop(path, "stored under another key")
        try:
            captured = _Unpickler(io.BytesIO(payload), bindings).load()
        except Stale as e:
            return self._drop(path, f"stale ({e})")
        except Exception as e:  # a payload that does not unpickle is corrupt, whatever it raises
            return self._drop(path, f"corrupt ({type(e).__name__}: {e})")
        from tinygrad.engine.jit import CapturedJit

        if not isinstance(captured, CapturedJit):
            return self._drop(path, "not a captured graph")
        _touch(path)
        return captured

    def store(self, key: Mapping[str, Any], captured: CapturedJit, bindings: Mapping[str, UOp],
              label: Mapping[str, Any] | None = None) -> bool:
        """Store `captured` under `key` (False, and nothing written, when it cannot be cached); then drop
        the least recently used entries beyond the size bound."""
        try:
            payload = dumps(captured, bindings)
        except (Uncacheable, pickle.PicklingError, TypeError, AttributeError, RecursionError) as e:
            log.info("graph not cached: %s", e)
            return False
        if not self.write(key, payload, label):
            return False
        self.evict()
        return True

    def write(self, key: Mapping[str, Any], payload: bytes, label: Mapping[str, Any] | None = None) -> bool:
        """Write an entry whole: under a temporary name, then renamed over `path_of(key)`."""
        header = {"key": json.loads(_canonical(key)), "label": dict(label or {}), "payload_bytes": len(payload),
                  "payload_sha256": hashlib.sha256(payload).hexdigest()}
        path = self.path_of(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                head = json.dumps(header).encode()
                f.write(MAGIC + struct.pack("<Q", len(head)) + head)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("graph cache %s: could not store a graph (%s)", self.root, e)
            tmp.unlink(missing_ok=True)
            return False
        return True

    def entries(self) -> list[Entry]:
        """Every entry, least recently used first (unreadable files are listed with an empty label)."""
        found = []
        for path in self._files():
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    label = _read_header(f).get("label", {})
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                label = {}
            found.append(Entry(path, st.st_size, st.st_mtime, label))
        return sorted(found, key=lambda e: e.last_used)

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def evict(self) -> int:
        """Delete the least recently used entries until the rest fit `max_bytes`; returns how many went."""
        sized = []
        for path in self._files():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            sized.append((st.st_mtime, st.st_size, path))
        sized.sort()
        total, gone = sum(s for _, s, _ in sized), 0
        for _, size, path in sized:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            gone += 1
        return gone

    def clear(self) -> tuple[int, int]:
        """Delete every entry (and leftovers of interrupted writes); returns (entries, bytes) deleted."""
        count = size = 0
        if not self.root.is_dir():
            return 0, 0
        for path in self.root.iterdir():
            if path.suffix in (SUFFIX, ".tmp") and path.is_file():
                try:
                    size += path.stat().st_size
                    path.unlink()
                    count += path.suffix == SUFFIX
                except FileNotFoundError:
                    continue
        return count, size

    def _files(self) -> list[Path]:
        return sorted(self.root.glob(f"*{SUFFIX}")) if self.root.is_dir() else []

    def _drop(self, path: Path, why: str) -> None:
        log.warning("graph cache: %s is %s; capturing the graph again", path.name, why)
        path.unlink(missing_ok=True)
        return None


def dumps(captured: CapturedJit, bindings: Mapping[str, UOp]) -> bytes:
    """The pickle of `captured` with its programs slimmed, `bindings` by name and its own buffers by size."""
    from tinygrad.engine.jit import CapturedJit

    names = {u: n for n, u in bindings.items()}
    slim = CapturedJit(captured.ret, _slim_programs(captured.linear), captured.expected_names,
                       captured.expected_input_info)
    out = io.BytesIO()
    _Pickler(out, names, _written_buffers(captured)).dump(slim)
    return out.getvalue()


class _Pickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO, names: dict[UOp, str], written: set[UOp]) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.names, self.written = names, written

    def persistent_id(self, obj: Any) -> Any:
        from tinygrad.device import Buffer, MultiBuffer
        from tinygrad.uop.ops import Ops, UOp

        if isinstance(obj, (Buffer, MultiBuffer)):
            raise Uncacheable("the graph holds a device buffer itself")
        if type(obj) is not UOp:
            return None
        if obj.op is Ops.BUFFER:
            if (name := self.names.get(obj)) is not None:
                return ("bound", name, obj.dtype, obj.arg, obj.device)
            if obj in self.written:
                return ("own", obj.dtype, obj.arg, obj.device, obj.src[0].arg)
            raise Uncacheable(f"the graph reads a buffer that is not bound ({obj.dtype}, {obj.arg} elements)")
        if obj.op in (Ops.UNIQUE, Ops.LUNIQUE):
            raise Uncacheable(f"the graph holds a {obj.op} outside a buffer")
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, bindings: Mapping[str, UOp]) -> None:
        super().__init__(f)
        self.bindings = bindings
        self.own: dict[Any, UOp] = {}

    def persistent_load(self, pid: Any) -> Any:
        from tinygrad.uop.ops import UOp

        if pid[0] == "bound":
            _, name, dtype, size, device = pid
            u = self.bindings.get(name)
            if u is None:
                raise Stale(f"this owner holds no buffer {name!r}")
            if (u.dtype, u.arg, u.device) != (dtype, size, device):
                raise Stale(f"{name!r} is {u.dtype} x {u.arg} on {u.device} here, {dtype} x {size} on {device} there")
            return u
        if pid[0] == "own":
            if pid not in self.own:
                _, dtype, size, device, _number = pid
                self.own[pid] = UOp.new_buffer(device, size, dtype)
            return self.own[pid]
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def _written_buffers(captured: CapturedJit) -> set[UOp]:
    """The buffers some call of the graph writes (views count for the buffer they view)."""
    from tinygrad.uop.ops import Ops

    out = set()
    for u in captured._written_uops:
        while u.op is Ops.BUFFER_VIEW:
            u = u.src[0]
        out.add(u)
    return out


@contextlib.contextmanager
def capturing_without_estimates() -> Iterator[None]:
    """Inside, a jit that captures gets its programs without tinygrad's cost estimates (the op and byte counts
    behind its statistics): building a captured graph's runner sums every kernel's symbolic estimates and
    simplifies the sum, about half of a graph's first replay on a small CPU. Only for captures on this thread
    (tinygrad never captures two graphs at once)."""
    import tinygrad.engine.jit as jit

    lower = jit.jit_lower

    def lower_without_estimates(linear: UOp, held_bufs: set[UOp], input_uops: list[UOp]) -> UOp:
        return _map_programs(lower(linear, held_bufs, input_uops), _without_estimates)

    jit.jit_lower = lower_without_estimates
    try:
        yield
    finally:
        jit.jit_lower = lower


def _without_estimates(program: UOp) -> UOp:
    from tinygrad.uop.ops import UOp

    sink = program.src[0]
    if getattr(sink.arg, "estimates", None) is None:
        return program
    return program.replace(src=(UOp(sink.op, sink.dtype, sink.src, replace(sink.arg, estimates=None), sink.tag),
                                *program.src[1:]))


def _slim(program: UOp) -> UOp:
    """A program reduced to what running it needs (see `_slim_programs`)."""
    from tinygrad.uop.ops import Ops, UOp

    if len(program.src) != 5:
        return program
    sink, device, _lin, source, binary = program.src
    stub = UOp(Ops.SINK, arg=replace(sink.arg, estimates=None)) if is_dataclass(sink.arg) else UOp(Ops.SINK)
    return program.replace(src=(stub, device, UOp(Ops.LINEAR), source, binary))


def _map_programs(linear: UOp, fn: Callable[[UOp], UOp]) -> UOp:
    """`linear` with each PROGRAM uop (in its calls and batched graphs) replaced by `fn(program)`."""
    from tinygrad.uop.ops import Ops

    memo: dict[UOp, UOp] = {}

    def walk(u: UOp) -> UOp:
        if (done := memo.get(u)) is not None:
            return done
        if u.op is Ops.PROGRAM:
            out = fn(u)
        else:
            src = tuple(walk(s) for s in u.src)
            out = u if src == u.src else u.replace(src=src)
        memo[u] = out
        return out

    return walk(linear)


def _slim_programs(linear: UOp) -> UOp:
    """`linear` with each program reduced to what running it needs: its binary, source and launch info
    (`ProgramInfo`), without the kernel AST and linearised instructions it was built from."""
    return _map_programs(linear, _slim)


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)


def _digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical(key).encode()).hexdigest()


def _read_header(f: Any) -> dict[str, Any]:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a graph cache entry")
    size = f.read(8)
    if len(size) != 8:
        raise ValueError("truncated header")
    (n,) = struct.unpack("<Q", size)
    if n > 1 << 24:
        raise ValueError("header too large")
    head = f.read(n)
    if len(head) != n:
        raise ValueError("truncated header")
    return json.loads(head)


def _read(f: Any) -> tuple[dict[str, Any], bytes]:
    header = _read_header(f)
    payload = f.read()
    if len(payload) != header.get("payload_bytes") or hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise ValueError("payload does not match its checksum")
    return header, payload


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
