"""Where a model's chunks are read from and written to: a whole GGUF file, or a partial model in the cache.

A partial model is what a daemon fetched of a model it was assigned part of:

    $cache/manifests/<digest>/model.gguf     the model's file as it will be, sparse: the header and the chunks
                                              held are written, the rest are holes (no disk used); a stage loads
                                              from it as from any GGUF, reading only its own tensors
    $cache/manifests/<digest>/manifest.cbor  the manifest without its header (that is model.gguf's first bytes)
    $cache/manifests/<digest>/held           one bit per chunk, set once the chunk is checked and written
    $cache/manifests/<digest>/names.json     the names the model was served under

A whole file elsewhere (a known model in the cache, a .gguf path, an Ollama blob) serves its chunks from
where it is; its manifest is remembered in `$cache/manifests/by-file/`, keyed by path, size and mtime.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import cbor2

from models.catalog.store import cache_dir
from models.errors import ModelError
from models.gguf.manifest import Manifest

MODEL_FILE = "model.gguf"
MANIFEST_FILE = "manifest.cbor"
HELD_FILE = "held"
NAMES_FILE = "names.json"


def manifests_dir() -> Path:
    return cache_dir() / "manifests"


class ChunkStore(abc.ABC):
    """A model's chunks, some or all of them held. `path` is the GGUF a stage loads from."""

    def __init__(self, manifest: Manifest, path: Path) -> None:
        self.manifest = manifest
        self.path = path

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @abc.abstractmethod
    def has(self, index: int) -> bool: ...

    def held(self) -> list[int]:
        return [c.index for c in self.manifest.chunks if self.has(c.index)]

    def held_bits(self) -> bytes:
        """One bit per chunk, chunk 0 in the top bit of the first byte."""
        bits = bytearray((len(self.manifest.chunks) + 7) // 8)
        for i in self.held():
            bits[i >> 3] |= 0x80 >> (i & 7)
        return bytes(bits)

    def missing(self, chunks: Iterable[int]) -> list[int]:
        return [i for i in chunks if not self.has(i)]

    def held_bytes(self) -> int:
        return sum(self.manifest.chunks[i].length for i in self.held())

    @property
    def complete(self) -> bool:
        return all(self.has(c.index) for c in self.manifest.chunks)

    def read(self, index: int) -> bytes:
        """The bytes of a held chunk (blocking: a disk read)."""
        chunk = self.manifest.chunks[index]
        if not self.has(index):
            raise ModelError(f"chunk {index} of {self.digest[:12]} is not held here")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = os.pread(fd, chunk.length, chunk.offset)
        finally:
            os.close(fd)
        if len(data) != chunk.length:
            raise ModelError(f"{self.path} ends inside chunk {index}")
        return data


class WholeFile(ChunkStore):
    """A complete GGUF file: every chunk is held."""

    def has(self, index: int) -> bool:
        return 0 <= index < len(self.manifest.chunks)

    def held(self) -> list[int]:
        return list(range(len(self.manifest.chunks)))

    @property
    def complete(self) -> bool:
        return True


class PartialModel(ChunkStore):
    """A model fetched chunk by chunk into the cache. Chunks are checked against the manifest before they are
    written; the record of which are held is saved by `flush` (a restart loses at most the unflushed ones)."""

    def __init__(self, manifest: Manifest, folder: Path, held: bytes, names: list[str]) -> None:
        super().__init__(manifest, folder / MODEL_FILE)
        self.folder = folder
        self.names = names
        self._bits = bytearray(held)
        self._dirty = False
        self._lock = threading.Lock()  # writes may come from worker threads

    # --- creating and opening -----------------------------------------------------------------------------
    @staticmethod
    def create(manifest: Manifest, name: str = "", root: Path | None = None) -> PartialModel:
        """An empty partial model for `manifest` (or the one already there, with `name` added)."""
        folder = (root or manifests_dir()) / manifest.digest
        if (folder / MANIFEST_FILE).is_file():
            existing = PartialModel.open(folder)
            existing.add_name(name)
            return existing
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / MODEL_FILE, "wb") as f:
            f.write(manifest.header)
            f.truncate(manifest.file_size)  # the rest is a hole until chunks land
        _write_atomic(folder / HELD_FILE, bytes((len(manifest.chunks) + 7) // 8))
        _write_atomic(folder / NAMES_FILE, json.dumps([name] if name else []).encode())
        _write_atomic(folder / MANIFEST_FILE, manifest.encode_without_header())  # last: its presence means ready
        return PartialModel(manifest, folder, bytes((len(manifest.chunks) + 7) // 8), [name] if name else [])

    @staticmethod
    def open(folder: Path) -> PartialModel:
        try:
            stored = (folder / MANIFEST_FILE).read_bytes()
            with open(folder / MODEL_FILE, "rb") as f:
                length = _header_length(f)
                f.seek(0)
                head = f.read(length)
            manifest = Manifest.decode(stored, header=head)
            held = (folder / HELD_FILE).read_bytes()
            names = json.loads((folder / NAMES_FILE).read_text())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelError(f"partial model in {folder} is unreadable ({type(e).__name__}): remove the folder") from None
        if manifest.digest != folder.name:
            raise ModelError(f"partial model in {folder} holds manifest {manifest.digest[:12]}, not its folder's name")
        if len(held) != (len(manifest.chunks) + 7) // 8:
            raise ModelError(f"partial model in {folder}: its record of held chunks has the wrong size")
        return PartialModel(manifest, folder, held, [str(n) for n in names if isinstance(n, str)])

    def add_name(self, name: str) -> None:
        if name and name not in self.names:
            self.names.append(name)
            _write_atomic(self.folder / NAMES_FILE, json.dumps(self.names).encode())

    # --- chunks -------------------------------------------------------------------------------------------
    def has(self, index: int) -> bool:
        return 0 <= index < len(self.manifest.chunks) and bool(self._bits[index >> 3] & (0x80 >> (index & 7)))

    def held(self) -> list[int]:
        return [i for i in range(len(self.manifest.chunks)) if self._bits[i >> 3] & (0x80 >> (i & 7))]

    def held_bits(self) -> bytes:
        with self._lock:
            return bytes(self._bits)

    def write(self, index: int, data: bytes) -> None:
        """Check `data` against the manifest and write it in place (blocking); ModelError if it is not chunk
        `index` (then nothing is written)."""
        chunk = self.manifest.chunks[index]
        if len(data) != chunk.length or hashlib.sha256(data).digest() != chunk.sha256:
            raise ModelError(f"chunk {index} ({chunk.tensor}) does not match the manifest")
        if self.has(index):
            return
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, chunk.offset)
        finally:
            os.close(fd)
        with self._lock:
            self._bits[index >> 3] |= 0x80 >> (index & 7)
            self._dirty = True

    def flush(self) -> None:
        """Make the chunks written so far survive a crash: data to disk first, then the record of them. Daemons
        sharing the cache share the record: chunks another one recorded are taken in, never dropped."""
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            recorded = (self.folder / HELD_FILE).read_bytes()
        except OSError:
            recorded = b""
        with self._lock:
            if len(recorded) == len(self._bits):
                for i, byte in enumerate(recorded):
                    self._bits[i] |= byte
            bits = bytes(self._bits)
        _write_atomic(self.folder / HELD_FILE, bits)

    def disk_bytes(self) -> int:
        """Bytes this partial model takes on disk (holes take none)."""
        return sum(p.stat().st_blocks * 512 for p in self.folder.iterdir() if p.is_file())


def _header_length(f) -> int:
    from models.gguf.header import parse_header

    header = parse_header(f, Path(getattr(f, "name", "model.gguf")))
    return header.data_start


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- finding models in the cache ----------------------------------------------------------------------------
def partial_models(root: Path | None = None) -> list[PartialModel]:
    """Every readable partial model in the cache (unreadable ones are skipped)."""
    out: list[PartialModel] = []
    base = root or manifests_dir()
    if not base.is_dir():
        return out
    for folder in sorted(base.iterdir()):
        if (folder / MANIFEST_FILE).is_file():
            with contextlib.suppress(ModelError):
                out.append(PartialModel.open(folder))
    return out


def find_partial(name: str = "", digest: str = "", root: Path | None = None) -> PartialModel | None:
    """The partial model served under `name`, or whose identity starts with `digest`."""
    for model in partial_models(root):
        if (digest and model.digest.startswith(digest)) or (name and name in model.names):
            return model
    return None


def whole_file(path: Path, progress: Callable[[int, int], None] | None = None) -> WholeFile:
    """A complete GGUF as a chunk store; its manifest is computed once (reading the whole file) and remembered
    by path, size and mtime in the cache."""
    stat = path.stat()
    resolved = str(path.resolve())
    stamp = {"path": resolved, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    memo = manifests_dir() / "by-file" / (hashlib.sha256(resolved.encode()).hexdigest()[:32] + ".cbor")
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ModelError):
        doc = cbor2.loads(memo.read_bytes())
        if {k: doc[k] for k in stamp} == stamp:
            with open(path, "rb") as f:
                head = f.read(doc["header_length"])
            manifest = Manifest.decode(doc["manifest"], header=head)
            if manifest.digest == doc["digest"]:
                return WholeFile(manifest, path)
    manifest = Manifest.from_gguf(path, progress=progress)
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(memo, cbor2.dumps({**stamp, "header_length": len(manifest.header), "digest": manifest.digest,
                                         "manifest": manifest.encode_without_header()}))
    return WholeFile(manifest, path)


def remembered_digest(path: Path) -> str | None:
    """The manifest identity of a whole file, if it was computed before (no file is read)."""
    try:
        stat = path.stat()
        resolved = str(path.resolve())
        memo = manifests_dir() / "by-file" / (hashlib.sha256(resolved.encode()).hexdigest()[:32] + ".cbor")
        doc = cbor2.loads(memo.read_bytes())
        if (doc["path"], doc["size"], doc["mtime_ns"]) == (resolved, stat.st_size, stat.st_mtime_ns):
            return str(doc["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None
