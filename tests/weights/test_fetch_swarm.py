"""Fetching weights between peers over the network seam's in-memory twin: exact ranges, several sources, bad
chunks, lost sources, relays, resuming, serving onward."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import trio

from models.catalog.chunk_store import PartialModel, WholeFile, whole_file
from models.errors import ModelError
from models.gguf.header import read_header
from swarmd.net.seam import StreamClosed
from swarmd.net.streams import read_frame, write_frame
from swarmd.testing.memory_network import MemoryHub, MemoryNetwork
from swarmd.weights.fetcher import Fetcher
from swarmd.weights.pacing import Pacer
from swarmd.weights.parts import ModelParts
from swarmd.weights.protocol import PROTOCOL, HeldRequest, Refusal, decode_reply, encode
from swarmd.weights.relay_rule import REFUSAL
from swarmd.weights.server import IDLE_TIMEOUT_S, STREAMS_PER_PEER, WeightsServer
from tests.weights.weight_files import big_gguf, dense_gguf


@pytest.fixture
def model_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SWARMD_MODELS", str(tmp_path / "cache"))
    return big_gguf(tmp_path / "big.gguf")


class Peer:
    """One peer of the twin: its endpoint, its chunks (a whole file or a partial model) and its server."""

    def __init__(self, hub: MemoryHub, name: str, store, rate: float = 0.0) -> None:
        self.net: MemoryNetwork = hub.endpoint(name)
        self.store = store
        self.server = WeightsServer(self.net, "big", lambda: self.store, Pacer(rate))
        self.net.serve(PROTOCOL, self.server.handle, bulk=True)  # as the daemon serves it

    def fetcher(self, *sources: str) -> Fetcher:
        return Fetcher(self.net, self.store, lambda: list(sources), refresh_s=0.05, retry_s=0.05, retry_max_s=0.2)


async def until(condition) -> None:
    while not condition():  # noqa: ASYNC110 - polled: the counters change inside the fetcher
        await trio.sleep(0.01)


async def start_hub(nursery: trio.Nursery) -> MemoryHub:
    hub = MemoryHub()
    await nursery.start(hub.run)
    return hub


def partial(tmp_path: Path, whole: WholeFile, name: str) -> PartialModel:
    return PartialModel.create(whole.manifest, "big", root=tmp_path / name)


def same_bytes(p: PartialModel, whole: WholeFile, chunks) -> bool:
    return all(p.read(i) == whole.read(i) for i in chunks)


async def test_a_daemon_fetches_exactly_the_chunks_of_its_stage(tmp_path, model_file, nursery):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    founder = Peer(hub, "F", whole)
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    parts = ModelParts(whole.manifest, read_header(model_file), 2, False)
    wanted = parts.stage((1, 2))  # the last block with the output norm and the (tied) head: the embedding
    await a.fetcher("F").fetch(wanted)
    assert a.store.held() == wanted and same_bytes(a.store, whole, wanted)
    assert founder.server.stats["chunks_served"] == len(wanted)
    expected = sum(whole.manifest.chunks[i].length for i in wanted) + len(whole.manifest.header)
    assert expected <= a.store.disk_bytes() <= expected * 1.05 + 64 * 1024  # holes take no disk
    assert parts.holdings(a.store.held()) == ("e", "h", "b1")  # the tied head is the embedding


async def test_chunks_come_from_several_sources_at_once_and_are_served_onward(tmp_path, model_file, nursery):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    Peer(hub, "F", whole, rate=4e6)
    Peer(hub, "G", whole_file(model_file), rate=4e6)
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    everything = [c.index for c in whole.manifest.chunks]
    fetch = a.fetcher("F", "G")
    await fetch.fetch(everything)
    assert fetch.bytes_from["F"] > 0 and fetch.bytes_from["G"] > 0
    assert sum(fetch.bytes_from.values()) == whole.manifest.tensor_bytes and a.store.complete
    hub.crash("F")
    hub.crash("G")
    b = Peer(hub, "B", partial(tmp_path, whole, "b"))
    await b.fetcher("F", "G", "A").fetch(everything)  # only A is left: it serves what it fetched
    assert same_bytes(b.store, whole, everything)


async def test_a_peer_sending_corrupt_chunks_is_struck_and_the_chunks_come_from_another(tmp_path, model_file,
                                                                                         nursery):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    liar = Peer(hub, "F", whole)
    liar.server.corrupt = True  # what SWARMD_TEST_CORRUPT_CHUNKS=1 switches on in a daemon
    Peer(hub, "G", whole_file(model_file), rate=2e6)  # slower: the liar is asked first
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    everything = [c.index for c in whole.manifest.chunks]
    fetch = a.fetcher("F", "G")
    await fetch.fetch(everything)
    assert fetch.stats["bad_chunks"] == 1 and fetch.bytes_from["F"] == 0
    assert a.net.gate.stats["strikes"] == 1
    assert same_bytes(a.store, whole, everything)


async def test_a_source_lost_mid_fetch_leaves_the_rest_to_another_holder(tmp_path, model_file, nursery):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    Peer(hub, "F", whole, rate=2e6)
    Peer(hub, "G", whole_file(model_file))
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    everything = [c.index for c in whole.manifest.chunks]
    fetch = a.fetcher("F")

    async def kill_f() -> None:
        await until(lambda: fetch.bytes_from["F"] >= 1 << 20)
        hub.crash("F")  # kill -9: its streams break mid-chunk
        fetch.sources = lambda: ["F", "G"]  # the other holder, as membership lists it

    nursery.start_soon(kill_f)
    with trio.fail_after(30):
        await fetch.fetch(everything)
    assert fetch.stats["sources_lost"] >= 1 and fetch.bytes_from["G"] > 0
    assert fetch.stats["bytes_fetched"] == whole.manifest.tensor_bytes  # nothing fetched twice
    assert same_bytes(a.store, whole, everything)


async def test_a_restarted_fetch_resumes_where_it_stopped(tmp_path, model_file, nursery):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    Peer(hub, "F", whole, rate=2e6)
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    everything = [c.index for c in whole.manifest.chunks]
    first = a.fetcher("F")
    with trio.move_on_after(10) as scope:
        async with trio.open_nursery() as inner:
            inner.start_soon(first.fetch, everything)
            await until(lambda: first.bytes_from["F"] >= 2 << 20)
            inner.cancel_scope.cancel()  # the daemon stops mid-fetch
    assert not scope.cancelled_caught
    kept = PartialModel.open(a.store.folder)  # what a restart finds on disk
    assert 2 << 20 <= kept.held_bytes() < whole.manifest.tensor_bytes
    again = Fetcher(a.net, kept, lambda: ["F"], refresh_s=0.05)
    await again.fetch(everything)
    assert again.stats["bytes_fetched"] == whole.manifest.tensor_bytes - first.stats["bytes_fetched"]
    assert same_bytes(kept, whole, everything)


async def test_weights_never_travel_through_a_relay(tmp_path, model_file, nursery):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    behind_relay = Peer(hub, "F", whole)
    Peer(hub, "G", whole_file(model_file))
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    hub.behind_nat("F")
    await behind_relay.net.connect("G")  # F dials out to G, which then relays for it
    await a.net.connect("F")
    assert a.net.is_relayed("F") and not a.net.is_relayed("G")
    everything = [c.index for c in whole.manifest.chunks]
    fetch = a.fetcher("F", "G")
    await fetch.fetch(everything)
    assert fetch.bytes_from["F"] == 0 and behind_relay.server.stats["chunks_served"] == 0
    # and the server refuses a relayed asker by itself
    stream = await a.net.open_stream("F", PROTOCOL)
    await write_frame(stream, encode(HeldRequest(whole.digest)))
    assert decode_reply(await read_frame(stream, 4096)) == Refusal(REFUSAL)


async def test_a_fetch_with_no_source_waits_and_says_why(tmp_path, model_file, nursery):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    fetch = a.fetcher()
    async with trio.open_nursery() as inner:
        inner.start_soon(fetch.fetch, [0, 1])
        await trio.sleep(0.5)
        assert fetch.progress.active and fetch.progress.waiting == "2 chunks have no source"
        Peer(hub, "F", whole)
        fetch.sources = lambda: ["F"]  # a holder joins
    assert a.store.held() == [0, 1] and not fetch.progress.active


async def test_garbage_requests_strike_the_asker(tmp_path, model_file, nursery):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    founder = Peer(hub, "F", whole)
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    stream = await a.net.open_stream("F", PROTOCOL)
    await write_frame(stream, b"\x82\x01\x02")  # a CBOR list, not a request
    with trio.fail_after(5):
        await until(lambda: founder.net.gate.stats["strikes"] >= 1)


def test_partial_models_keep_their_chunks_and_the_record_of_them_across_opens(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMD_MODELS", str(tmp_path / "cache"))
    whole = whole_file(dense_gguf(tmp_path / "d.gguf"))
    p = PartialModel.create(whole.manifest, "tiny")
    p.write(3, whole.read(3))
    with pytest.raises(ModelError, match="does not match the manifest"):
        p.write(4, whole.read(5))
    p.flush()
    again = PartialModel.open(p.folder)
    assert again.held() == [3] and again.names == ["tiny"] and again.digest == whole.digest
    assert hashlib.sha256(again.read(3)).digest() == whole.manifest.chunks[3].sha256
    assert PartialModel.create(whole.manifest, "other").names == ["tiny", "other"]


def test_daemons_sharing_a_cache_share_the_record_of_chunks_held(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMD_MODELS", str(tmp_path / "cache"))
    whole = whole_file(dense_gguf(tmp_path / "d.gguf"))
    one = PartialModel.create(whole.manifest, "tiny")
    two = PartialModel.open(one.folder)  # a second daemon on the same machine
    one.write(1, whole.read(1))
    one.flush()
    two.write(2, whole.read(2))
    two.flush()
    assert PartialModel.open(one.folder).held() == [1, 2] and two.held() == [1, 2]


async def test_a_cancelled_fetch_keeps_what_arrived_and_is_no_longer_shown_as_running(tmp_path, model_file, nursery):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    Peer(hub, "F", whole, rate=2e6)
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    fetch = a.fetcher("F")
    with trio.move_on_after(0.8):  # the plan gave the blocks to another daemon meanwhile
        await fetch.fetch([c.index for c in whole.manifest.chunks])
    assert not fetch.progress.active and 0 < fetch.progress.done < whole.manifest.tensor_bytes
    assert PartialModel.open(a.store.folder).held_bytes() == fetch.progress.done  # flushed on the way out


async def test_a_server_closes_idle_streams_and_serves_few_at_once_to_one_peer(tmp_path, model_file, nursery,
                                                                              autojump_clock):
    hub = await start_hub(nursery)
    whole = whole_file(model_file)
    f = Peer(hub, "F", whole)
    a = Peer(hub, "A", partial(tmp_path, whole, "a"))
    streams = []
    for _ in range(STREAMS_PER_PEER):
        stream = await a.net.open_stream("F", PROTOCOL, bulk=True)
        await write_frame(stream, encode(HeldRequest(whole.digest)))
        await read_frame(stream, 4096)
        streams.append(stream)
    one_more = await a.net.open_stream("F", PROTOCOL, bulk=True)
    refusal = decode_reply(await read_frame(one_more, 4096))
    assert isinstance(refusal, Refusal) and "at once" in refusal.reason
    await trio.sleep(IDLE_TIMEOUT_S + 1)  # nobody asks anything on them
    for stream in streams:
        with pytest.raises(StreamClosed):
            await read_frame(stream, 4096)
    assert f.server.stats["idle_streams_closed"] == STREAMS_PER_PEER
    await a.fetcher("F").fetch([0, 1])  # and a new fetch is served
    assert a.store.held() == [0, 1]
