"""Read a GGUF file's header: its metadata and where each tensor's bytes lie, without loading them.

Uses tinygrad.llm.gguf's value readers, so both sides agree on the format.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import ModelError


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (ggml's ne reversed)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    n_elements: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    kv: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int = 0  # where the tensor data begins: the header is the file's bytes before it

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.kv.get(f"{self.arch}.{key}", default)


def read_header(path: str | Path) -> GGUFHeader:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no such model file: {path}")
    with open(path, "rb") as raw:
        return parse_header(io.BufferedReader(raw, 1 << 20), path)


def parse_header(r: io.BufferedIOBase, path: Path) -> GGUFHeader:
    """The header read from `r` (a file, or a GGUF's header bytes); `path` names the model in errors."""
    from tinygrad.helpers import prod, round_up
    from tinygrad.llm.gguf import read_int32, read_int64, read_str, read_uint32, read_uint64, readers

    magic = r.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (its first bytes are {magic!r})")
    version = read_int32(r)
    if version not in (2, 3):
        raise ModelError(f"{path}: GGUF version {version} is not supported (2 or 3 are)")
    n_tensors, n_kv = read_int64(r), read_int64(r)
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key, typ = read_str(r), read_int32(r)
        kv[key] = readers[typ](r)
    infos = []
    for _ in range(n_tensors):
        name = read_str(r)
        dims = tuple(read_uint64(r) for _ in range(read_uint32(r)))
        typ, off = read_int32(r), read_uint64(r)
        infos.append((name, dims, typ, off))
    data_start = round_up(r.tell(), kv.get("general.alignment", 32))
    tensors = {
        name: TensorInfo(name, tuple(reversed(dims)), typ, data_start + off, prod(dims))
        for name, dims, typ, off in infos
    }
    return GGUFHeader(path, kv, tensors, data_start)
