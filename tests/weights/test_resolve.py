"""Which model a starting daemon serves: on this machine first, else from the members, else made locally."""

from __future__ import annotations

import pytest
import trio

from models.catalog.chunk_store import find_partial, whole_file
from models.errors import ModelError
from swarmd.daemon.model_source import resolve_served
from swarmd.testing.memory_network import MemoryHub
from swarmd.weights.pacing import Pacer
from swarmd.weights.protocol import (
    PROTOCOL,
    ChunkReply,
    GetRequest,
    HeldReply,
    ManifestRequest,
    Refusal,
    decode_reply,
    decode_request,
    encode,
)
from swarmd.weights.server import WeightsServer
from tests.weights.weight_files import dense_gguf


@pytest.fixture
def founder_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMD_MODELS", str(tmp_path / "founder-cache"))
    store = whole_file(dense_gguf(tmp_path / "tiny.gguf"))
    monkeypatch.setenv("SWARMD_MODELS", str(tmp_path / "joiner-cache"))  # the joiner's own, empty cache
    return store


async def founder(nursery, store) -> MemoryHub:
    hub = MemoryHub()
    await nursery.start(hub.run)
    net = hub.endpoint("F")
    net.serve(PROTOCOL, WeightsServer(net, "tiny-llama", lambda: store, Pacer(0)).handle)
    return hub


async def test_a_daemon_with_no_file_serves_the_members_model_by_name_or_by_identity(founder_file, nursery):
    hub = await founder(nursery, founder_file)
    model = await resolve_served("tiny-llama", hub.endpoint("J"), [("F", "/memory/F")])
    assert (model.name, model.digest) == ("tiny-llama", founder_file.digest)
    assert model.layout.digest == founder_file.digest and model.layout.n_blocks == 4
    assert model.layout.stored_bytes == founder_file.manifest.tensor_bytes
    assert model.store is not None and model.store.held() == []  # nothing fetched before the plan says what
    again = await resolve_served(f"manifest:{founder_file.digest[:12]}", hub.endpoint("K"), [("F", "/memory/F")])
    assert again.store.path == model.store.path and again.name == "tiny-llama"  # the same partial model
    assert find_partial(name="tiny-llama").digest == founder_file.digest


async def test_a_restart_finds_its_partial_model_even_when_no_member_answers(founder_file, nursery):
    hub = await founder(nursery, founder_file)
    first = await resolve_served("tiny-llama", hub.endpoint("J"), [("F", "/memory/F")])
    first.store.write(0, founder_file.read(0))
    first.store.flush()
    hub.crash("F")
    with trio.fail_after(20):
        later = await resolve_served("tiny-llama", hub.endpoint("J"), [("F", "/memory/F")], wait_s=1.0)
    assert later.store.held() == [0] and later.digest == founder_file.digest


async def test_a_model_no_member_serves_is_made_here_or_refused_in_one_line(founder_file, nursery):
    hub = await founder(nursery, founder_file)
    with pytest.raises(ModelError, match="unknown model 'other'"):
        await resolve_served("other", hub.endpoint("J"), [("F", "/memory/F")])
    with pytest.raises(ModelError, match="no member serves manifest:0123456789ab"):
        await resolve_served("manifest:0123456789ab", hub.endpoint("K"), [("F", "/memory/F")])


def test_requests_and_replies_are_strict():
    assert decode_request(encode(GetRequest("d" * 64, (1, 2)))) == GetRequest("d" * 64, (1, 2))
    assert decode_request(encode(ManifestRequest("smollm2-135m"))) == ManifestRequest("smollm2-135m")
    assert decode_reply(encode(ChunkReply(3, b"xyz"))) == ChunkReply(3, b"xyz")
    assert decode_reply(encode(Refusal("not held here", 4))) == Refusal("not held here", 4)
    assert decode_reply(encode(HeldReply(b"\x80"))) == HeldReply(b"\x80")
    import cbor2

    from swarmd.errors import RemoteProtocolError

    for junk in ({"t": "get", "model": "d", "chunks": []}, {"t": "get", "model": "d", "chunks": [-1]},
                 {"t": "get", "model": "d", "chunks": list(range(65))}, {"t": "held"}, {"t": "launch"},
                 {"t": "manifest", "model": "x", "extra": 1}):
        with pytest.raises(RemoteProtocolError):
            decode_request(cbor2.dumps(junk))
    for junk in ({"t": "chunk", "i": 1, "data": b""}, {"t": "no"}, {"t": "held", "bits": "x"}):
        with pytest.raises(RemoteProtocolError):
            decode_reply(cbor2.dumps(junk))
    with pytest.raises(RemoteProtocolError, match="too short"):
        decode_reply(b"C\x00\x01")
