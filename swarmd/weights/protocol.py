"""The weights protocol, `/swarmd/weights/1.0.0`: a model's manifest and chunks, asked of a peer that holds them.

Frames are the seam's (4-byte length, then the payload). The asker speaks first; the server answers every
request in order, so an asker may send several before reading. Requests and answers are strict CBOR maps, but
for a chunk: "C", its index as 4 big-endian bytes, then its bytes as they are (a chunk is most of the traffic,
and a megabyte through the strict CBOR decoder costs ten times its copy).

    {"t": "manifest", "model": NAME | "manifest:HASH"}  ->  {"t": "manifest", "name": NAME, "manifest": bytes}
    {"t": "held", "model": DIGEST}                      ->  {"t": "held", "bits": bytes}  (one bit per chunk)
    {"t": "get", "model": DIGEST, "chunks": [i, ...]}   ->  per chunk, in order:
                                                              "C" index data
                                                              or {"t": "no", "i": i, "reason": str}
    anything the server cannot answer                   ->  {"t": "no", "reason": str}

A chunk is checked by the asker against the manifest before use; the server only ever sends what it holds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from swarmd.errors import RemoteProtocolError
from swarmd.wire.codec import decode_cbor, encode_cbor

PROTOCOL = "/swarmd/weights/1.0.0"
MAX_REQUEST_BYTES = 64 << 10
MAX_CHUNKS_PER_GET = 64
MAX_MANIFEST_FRAME = 256 << 20
MAX_REASON = 300
CHUNK_TAG = b"C"  # never the first byte of a CBOR map (0xa0-0xbf)
CHUNK_INDEX = struct.Struct(">I")


@dataclass(frozen=True)
class ManifestRequest:
    model: str


@dataclass(frozen=True)
class HeldRequest:
    model: str


@dataclass(frozen=True)
class GetRequest:
    model: str
    chunks: tuple[int, ...]


Request = ManifestRequest | HeldRequest | GetRequest


@dataclass(frozen=True)
class ManifestReply:
    name: str
    manifest: bytes


@dataclass(frozen=True)
class HeldReply:
    bits: bytes


@dataclass(frozen=True)
class ChunkReply:
    index: int
    data: bytes


@dataclass(frozen=True)
class Refusal:
    reason: str
    index: int | None = None  # the chunk refused, or None: the whole request


Reply = ManifestReply | HeldReply | ChunkReply | Refusal


def encode(msg: Request | Reply) -> bytes:
    doc: dict[str, Any]
    if isinstance(msg, ManifestRequest):
        doc = {"t": "manifest", "model": msg.model}
    elif isinstance(msg, HeldRequest):
        doc = {"t": "held", "model": msg.model}
    elif isinstance(msg, GetRequest):
        doc = {"t": "get", "model": msg.model, "chunks": list(msg.chunks)}
    elif isinstance(msg, ManifestReply):
        doc = {"t": "manifest", "name": msg.name, "manifest": msg.manifest}
    elif isinstance(msg, HeldReply):
        doc = {"t": "held", "bits": msg.bits}
    elif isinstance(msg, ChunkReply):
        return CHUNK_TAG + CHUNK_INDEX.pack(msg.index) + msg.data
    else:
        doc = {"t": "no", "reason": msg.reason[:MAX_REASON], **({"i": msg.index} if msg.index is not None else {})}
    return encode_cbor(doc)


def decode_request(data: bytes) -> Request:
    """What an asker sent; RemoteProtocolError (a strike against it) for anything else."""
    doc = _map(data)
    kind = doc.get("t")
    if kind == "manifest" and _keys(doc, {"t", "model"}) and _text(doc["model"]):
        return ManifestRequest(doc["model"])
    if kind == "held" and _keys(doc, {"t", "model"}) and _text(doc["model"]):
        return HeldRequest(doc["model"])
    if kind == "get" and _keys(doc, {"t", "model", "chunks"}) and _text(doc["model"]):
        chunks = doc["chunks"]
        if (isinstance(chunks, list) and 0 < len(chunks) <= MAX_CHUNKS_PER_GET
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in chunks)):
            return GetRequest(doc["model"], tuple(chunks))
    raise RemoteProtocolError(f"not a weights request: {_describe(doc)}")


def decode_reply(data: bytes) -> Reply:
    """What a server answered; RemoteProtocolError for anything else."""
    if data[:1] == CHUNK_TAG:
        if len(data) < 1 + CHUNK_INDEX.size:
            raise RemoteProtocolError("a chunk frame too short for its index")
        return ChunkReply(CHUNK_INDEX.unpack_from(data, 1)[0], data[1 + CHUNK_INDEX.size:])
    doc = _map(data)
    kind = doc.get("t")
    if kind == "held" and _keys(doc, {"t", "bits"}) and isinstance(doc["bits"], bytes):
        return HeldReply(doc["bits"])
    if (kind == "manifest" and _keys(doc, {"t", "name", "manifest"}) and _text(doc["name"])
            and isinstance(doc["manifest"], bytes)):
        return ManifestReply(doc["name"], doc["manifest"])
    if kind == "no" and set(doc) in ({"t", "reason"}, {"t", "reason", "i"}) and isinstance(doc["reason"], str):
        index = doc.get("i")
        if index is None or _index(index):
            return Refusal(doc["reason"][:MAX_REASON], index)
    raise RemoteProtocolError(f"not a weights reply: {_describe(doc)}")


def bits_to_chunks(bits: bytes, n_chunks: int) -> frozenset[int]:
    """The chunks a `held` bitmap names (chunk 0 is the first byte's top bit); RemoteProtocolError if its size
    is not the model's."""
    if len(bits) != (n_chunks + 7) // 8:
        raise RemoteProtocolError(f"a held bitmap of {len(bits)} bytes for {n_chunks} chunks")
    return frozenset(i for i in range(n_chunks) if bits[i >> 3] & (0x80 >> (i & 7)))


def _map(data: bytes) -> dict[str, Any]:
    doc = decode_cbor(data)
    if not isinstance(doc, dict):
        raise RemoteProtocolError("a weights frame must be a CBOR map")
    return doc


def _keys(doc: dict[str, Any], keys: set[str]) -> bool:
    return set(doc) == keys


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 4096


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _describe(doc: dict[str, Any]) -> str:
    return f"type {str(doc.get('t'))[:20]!r} with keys {sorted(map(str, doc))[:8]}"
