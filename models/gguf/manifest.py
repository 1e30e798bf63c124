"""A model as a manifest: its GGUF header and, per tensor, name, shape, type, byte range and chunk hashes.

The header is the file's bytes before its first tensor (metadata, tokenizer, tensor table); every tensor's
bytes are cut into chunks of at most `chunk_bytes`, and each chunk's sha256 is listed. The manifest's own
sha256 (of its canonical CBOR) is the model's identity: the same weights give the same identity whatever
the file is called, and any chunk can be checked on its own against it. Chunks never cross a tensor, nor
an expert of a stacked routed-expert tensor (`blk.N.ffn_*_exps.weight`, one unit per expert), so the bytes
of any assignment (a block range, some experts) are a set of whole chunks.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import cbor2

from models.errors import ModelError
from models.gguf.header import GGUFHeader, parse_header

MANIFEST_VERSION = 1
PREFIX = "manifest:"  # `--model manifest:HASH` names a model by its identity
MIN_CHUNK = 1 << 20
MAX_CHUNKS = 1 << 16  # the chunk size doubles until a model has at most about this many chunks
MAX_CHUNK = 1 << 26
HASH_BYTES = 32
MAX_MANIFEST_BYTES = 256 << 20  # a header (vocabulary included) and hashes of a 1 T-parameter model fit
EXPERT_SUFFIX = "_exps.weight"  # stacked routed experts: one unit per expert


def chunk_size_for(total_bytes: int) -> int:
    """The chunk size for a model of `total_bytes`: 1 MiB, doubled until the chunks number at most MAX_CHUNKS."""
    size = MIN_CHUNK
    while size < MAX_CHUNK and total_bytes > size * MAX_CHUNKS:
        size *= 2
    return size


@dataclass(frozen=True)
class Chunk:
    index: int  # position in the manifest's chunk list
    tensor: str
    unit: int  # the expert, for a stacked expert tensor; else 0
    offset: int  # absolute offset in the GGUF file
    length: int
    sha256: bytes


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # numpy order, as models.gguf.header gives it
    ggml_type: int
    offset: int  # absolute offset in the file
    nbytes: int
    units: int  # experts stacked in the tensor (each is chunked on its own), else 1
    hashes: tuple[bytes, ...]  # one per chunk, in file order

    def spans(self, chunk_bytes: int) -> list[tuple[int, int, int]]:
        """(unit, offset, length) of each chunk, in file order."""
        per_unit = self.nbytes // self.units
        out = []
        for unit in range(self.units):
            start = self.offset + unit * per_unit
            for at in range(0, per_unit, chunk_bytes):
                out.append((unit, start + at, min(chunk_bytes, per_unit - at)))
        return out


def units_of(name: str, shape: tuple[int, ...]) -> int:
    return shape[0] if name.endswith(EXPERT_SUFFIX) and len(shape) == 3 else 1


@dataclass(frozen=True)
class Manifest:
    header: bytes
    file_size: int
    chunk_bytes: int
    tensors: tuple[TensorEntry, ...]
    version: int = MANIFEST_VERSION
    _index: dict[str, TensorEntry] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({t.name: t for t in self.tensors})

    # --- identity -----------------------------------------------------------------------------------------
    def encode(self) -> bytes:
        """Canonical CBOR: the same manifest always gives the same bytes, hence the same identity."""
        return cbor2.dumps(self._doc(self.header), canonical=True)

    @cached_property
    def digest(self) -> str:
        """The model's identity: sha256 hex of `encode()`."""
        return hashlib.sha256(self.encode()).hexdigest()

    @property
    def name_in_swarm(self) -> str:
        return f"{PREFIX}{self.digest}"

    def _doc(self, header: bytes) -> dict[str, Any]:
        return {"v": self.version, "header": header, "size": self.file_size, "chunk": self.chunk_bytes,
                "tensors": [[t.name, list(t.shape), t.ggml_type, t.offset, t.nbytes, t.units, b"".join(t.hashes)]
                            for t in self.tensors]}

    # --- chunks -------------------------------------------------------------------------------------------
    @cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        out: list[Chunk] = []
        for t in self.tensors:
            for (unit, offset, length), digest in zip(t.spans(self.chunk_bytes), t.hashes, strict=True):
                out.append(Chunk(len(out), t.name, unit, offset, length, digest))
        return tuple(out)

    @cached_property
    def _first_chunk(self) -> dict[str, int]:
        first: dict[str, int] = {}
        for c in self.chunks:
            first.setdefault(c.tensor, c.index)
        return first

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def tensor(self, name: str) -> TensorEntry:
        try:
            return self._index[name]
        except KeyError:
            raise ModelError(f"tensor {name} is not in the model's manifest") from None

    def chunks_of(self, names: Iterable[str] = (), experts: Mapping[int, Iterable[int]] | None = None) -> list[int]:
        """The chunks holding the tensors `names` whole, and the experts `experts[block]` of every routed-expert
        tensor of those blocks; in file order."""
        wanted: set[int] = set()
        for name in names:
            first, n = self._first_chunk[self.tensor(name).name], len(self.tensor(name).hashes)
            wanted.update(range(first, first + n))
        for block, es in (experts or {}).items():
            stacked = [t for t in self.tensors if t.name.startswith(f"blk.{block}.") and t.units > 1]
            if not stacked:
                raise ModelError(f"block {block} has no routed experts in the manifest")
            for t in stacked:
                per_unit = len(t.hashes) // t.units
                first = self._first_chunk[t.name]
                for e in es:
                    if not 0 <= e < t.units:
                        raise ModelError(f"block {block} has {t.units} experts, not expert {e}")
                    wanted.update(range(first + e * per_unit, first + (e + 1) * per_unit))
        return sorted(wanted)

    def gguf_header(self, path: Path) -> GGUFHeader:
        """The GGUF header the manifest carries, as if read from `path`."""
        return parse_header(io.BytesIO(self.header), path)

    # --- building and reading -----------------------------------------------------------------------------
    @staticmethod
    def from_gguf(path: str | Path, *, chunk_bytes: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> Manifest:
        """Hash every chunk of the GGUF at `path` (reads the whole file once)."""
        from models.gguf.header import read_header
        from models.gguf.loader import tensor_nbytes

        path = Path(path)
        header = read_header(path)
        size = path.stat().st_size
        infos = sorted(header.tensors.values(), key=lambda t: t.offset)
        total = sum(tensor_nbytes(t) for t in infos)
        chunk = chunk_bytes or chunk_size_for(total)
        done = 0
        entries = []
        with open(path, "rb") as f:
            head = f.read(header.data_start)
            for info in infos:
                nbytes = tensor_nbytes(info)
                entry = TensorEntry(info.name, info.shape, info.ggml_type, info.offset, nbytes,
                                    units_of(info.name, info.shape), ())
                if nbytes % entry.units:
                    raise ModelError(f"{path.name}: tensor {info.name} does not split into {entry.units} experts")
                hashes = []
                for _, offset, length in entry.spans(chunk):
                    f.seek(offset)
                    data = f.read(length)
                    if len(data) != length:
                        raise ModelError(f"{path.name}: file ends inside tensor {info.name}; it is incomplete")
                    hashes.append(hashlib.sha256(data).digest())
                    done += length
                    if progress is not None:
                        progress(done, total)
                entries.append(TensorEntry(entry.name, entry.shape, entry.ggml_type, entry.offset, nbytes,
                                           entry.units, tuple(hashes)))
        manifest = Manifest(head, size, chunk, tuple(entries))
        manifest.check()
        return manifest

    @staticmethod
    def decode(data: bytes, *, header: bytes | None = None) -> Manifest:
        """A manifest from `encode()`'s bytes, checked (ModelError names what is wrong). With `header`, the
        bytes were made by `encode_without_header` and this is the header they lack."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ModelError(f"a manifest of {len(data)} bytes is over the {MAX_MANIFEST_BYTES} byte limit")
        try:
            doc = cbor2.loads(data)
        except Exception as e:
            raise ModelError(f"a manifest must be CBOR: {type(e).__name__}") from None
        if not isinstance(doc, dict) or set(doc) != {"v", "header", "size", "chunk", "tensors"}:
            raise ModelError("a manifest is a map of v, header, size, chunk and tensors")
        if doc["v"] != MANIFEST_VERSION:
            raise ModelError(f"manifest version {str(doc['v'])[:20]} is not {MANIFEST_VERSION}")
        head = doc["header"] if header is None else header
        if not isinstance(head, bytes) or not _int(doc["size"]) or not _int(doc["chunk"]):
            raise ModelError("a manifest's header must be bytes, its size and chunk size integers")
        if not isinstance(doc["tensors"], list):
            raise ModelError("a manifest's tensors must be a list")
        tensors = []
        for row in doc["tensors"]:
            if not (isinstance(row, list) and len(row) == 7 and isinstance(row[0], str) and isinstance(row[1], list)
                    and all(_int(x, zero=True) for x in [*row[1], row[2], row[3], row[4], row[5]])
                    and isinstance(row[6], bytes) and len(row[6]) % HASH_BYTES == 0):
                raise ModelError("a manifest tensor is [name, shape, type, offset, bytes, units, hashes]")
            hashes = tuple(row[6][i:i + HASH_BYTES] for i in range(0, len(row[6]), HASH_BYTES))
            tensors.append(TensorEntry(row[0], tuple(row[1]), row[2], row[3], row[4], row[5], hashes))
        manifest = Manifest(head, doc["size"], doc["chunk"], tuple(tensors))
        manifest.check()
        return manifest

    def encode_without_header(self) -> bytes:
        """The manifest with an empty header, for storing beside a file that holds the header itself."""
        return cbor2.dumps(self._doc(b""), canonical=True)

    def check(self) -> None:
        """Everything a peer could get wrong: the header parses and names exactly these tensors; ranges lie
        inside the file, after the header, without overlap; every chunk has its hash."""
        if not MIN_CHUNK <= self.chunk_bytes <= MAX_CHUNK or self.chunk_bytes & (self.chunk_bytes - 1):
            raise ModelError(f"manifest chunk size {self.chunk_bytes} is not a power of two of 1-64 MiB")
        try:
            header = self.gguf_header(Path("manifest"))
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"the manifest's GGUF header does not parse: {type(e).__name__}") from None
        if header.data_start != len(self.header):
            raise ModelError("the manifest's header does not end where the tensor data begins")
        if len(self._index) != len(self.tensors) or set(self._index) != set(header.tensors):
            raise ModelError("the manifest's tensors are not the ones its header lists")
        from models.gguf.loader import tensor_nbytes

        end = len(self.header)
        for t in sorted(self.tensors, key=lambda t: t.offset):
            info = header.tensors[t.name]
            if (info.offset, info.shape, info.ggml_type, tensor_nbytes(info)) != (t.offset, t.shape, t.ggml_type,
                                                                                 t.nbytes):
                raise ModelError(f"manifest entry {t.name} disagrees with its header")
            if t.units != units_of(t.name, t.shape) or t.nbytes % t.units or t.offset < end:
                raise ModelError(f"manifest entry {t.name} has a bad range or unit count")
            if len(t.hashes) != len(t.spans(self.chunk_bytes)):
                raise ModelError(f"manifest entry {t.name} lists {len(t.hashes)} chunk hashes, "
                                 f"not {len(t.spans(self.chunk_bytes))}")
            end = t.offset + t.nbytes
        if end > self.file_size:
            raise ModelError(f"the manifest's tensors end at byte {end}, past the file's {self.file_size}")


def _int(value: Any, *, zero: bool = False) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)


def parse_manifest_name(spec: str) -> str | None:
    """The (possibly shortened) hex identity in `manifest:HASH`, or None if `spec` names no manifest."""
    if not spec.startswith(PREFIX):
        return None
    digest = spec[len(PREFIX):].lower()
    if len(digest) < 12 or len(digest) > 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ModelError(f"{spec!r}: give at least 12 hex digits of the manifest's sha256 after 'manifest:'")
    return digest
