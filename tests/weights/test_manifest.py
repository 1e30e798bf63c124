"""A model is a manifest: its header, and per tensor its range and chunk hashes; its hash is the identity."""

from __future__ import annotations

import hashlib

import cbor2
import pytest

from models.errors import ModelError
from models.gguf.header import read_header
from models.gguf.manifest import MIN_CHUNK, Manifest, chunk_size_for, parse_manifest_name
from tests.weights.weight_files import big_gguf, dense_gguf, moe_gguf


def test_the_manifest_lists_every_tensor_with_its_range_and_the_hash_of_each_chunk(tmp_path):
    path = big_gguf(tmp_path / "big.gguf")
    m = Manifest.from_gguf(path)
    header = read_header(path)
    data = path.read_bytes()
    assert m.header == data[:header.data_start] and m.file_size == len(data)
    assert {t.name for t in m.tensors} == set(header.tensors)
    for c in m.chunks:
        assert hashlib.sha256(data[c.offset:c.offset + c.length]).digest() == c.sha256
    embedding = [c for c in m.chunks if c.tensor == "token_embd.weight"]
    assert [c.length for c in embedding] == [MIN_CHUNK] * 3  # 6144 x 128 float32: three whole chunks
    # chunks never cross a tensor: together they are exactly the tensors' bytes
    assert sum(c.length for c in m.chunks) == m.tensor_bytes == sum(t.nbytes for t in m.tensors)


def test_the_identity_follows_the_bytes_not_the_file_name(tmp_path):
    a = Manifest.from_gguf(dense_gguf(tmp_path / "a.gguf"))
    b = Manifest.from_gguf(dense_gguf(tmp_path / "b.gguf"))
    c = Manifest.from_gguf(dense_gguf(tmp_path / "c.gguf", seed=1))
    assert a.digest == b.digest != c.digest
    assert a.digest == hashlib.sha256(a.encode()).hexdigest()
    assert Manifest.decode(a.encode()) == a and Manifest.decode(a.encode()).digest == a.digest
    assert Manifest.decode(a.encode_without_header(), header=a.header).digest == a.digest


def test_each_expert_of_a_stacked_tensor_is_chunked_on_its_own(tmp_path):
    m = Manifest.from_gguf(moe_gguf(tmp_path / "moe.gguf"))
    gate = m.tensor("blk.1.ffn_gate_exps.weight")
    assert gate.units == 6 and len(gate.hashes) == 6
    one = m.chunks_of((), {1: [4]})
    assert sorted((m.chunks[i].tensor, m.chunks[i].unit) for i in one) == [
        ("blk.1.ffn_down_exps.weight", 4), ("blk.1.ffn_gate_exps.weight", 4), ("blk.1.ffn_up_exps.weight", 4)]
    assert sum(m.chunks[i].length for i in one) == sum(m.tensor(f"blk.1.ffn_{t}_exps.weight").nbytes
                                                       for t in ("gate", "up", "down")) // 6
    with pytest.raises(ModelError, match="has 6 experts"):
        m.chunks_of((), {1: [6]})
    with pytest.raises(ModelError, match="no routed experts"):
        m.chunks_of((), {0: [0]})


def _tampered(m: Manifest, edit) -> bytes:
    doc = cbor2.loads(m.encode())
    edit(doc)
    return cbor2.dumps(doc)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["tensors"][0].__setitem__(3, d["tensors"][0][3] + 32), "disagrees with its header"),
    (lambda d: d["tensors"][0].__setitem__(6, d["tensors"][0][6][:-32]), "chunk hashes"),
    (lambda d: d["tensors"].pop(), "not the ones its header lists"),
    (lambda d: d.__setitem__("header", d["header"][:-8]), "header"),
    (lambda d: d.__setitem__("chunk", 3 << 20), "power of two"),
    (lambda d: d.__setitem__("size", 100), "past the file"),
    (lambda d: d.__setitem__("extra", 1), "a map of"),
    (lambda d: d["tensors"][1].__setitem__(0, 7), "a manifest tensor is"),
])
def test_a_manifest_that_does_not_hold_together_is_refused_in_one_line(tmp_path, edit, message):
    m = Manifest.from_gguf(dense_gguf(tmp_path / "a.gguf"))
    with pytest.raises(ModelError, match=message) as err:
        Manifest.decode(_tampered(m, edit))
    assert "\n" not in str(err.value)
    with pytest.raises(ModelError, match="CBOR"):
        Manifest.decode(b"\xff\x00junk")


def test_chunks_grow_with_the_model_so_a_manifest_stays_small():
    assert chunk_size_for(100 << 20) == MIN_CHUNK
    assert chunk_size_for(64 << 30) == 1 << 20
    assert chunk_size_for(600 << 30) == 16 << 20  # Kimi-K2 at int4: under 40k chunks
    assert (600 << 30) / chunk_size_for(600 << 30) <= 1 << 16


def test_manifest_names_take_at_least_twelve_hex_digits():
    assert parse_manifest_name("manifest:ABCDEF0123456789") == "abcdef0123456789"
    assert parse_manifest_name("smollm2-135m") is None
    for bad in ("manifest:abc", "manifest:xyz0123456789", "manifest:" + "0" * 65):
        with pytest.raises(ModelError, match="12 hex digits"):
            parse_manifest_name(bad)
