"""The actor transport over the daemon's real `Libp2pNetwork` on loopback (several in one process), with
and without the TLS data plane."""

from __future__ import annotations

import cbor2
import numpy as np
import pytest
import trio

from swarmd.net.framing import HEADER
from swarmd.net.gate import GuardLimits
from swarmd.net.seam import LinkPath, StreamClosed
from swarmd.net.streams import Libp2pStream, TrioStream, read_frame, write_frame
from swarmd.net.tls_plane import make_certificate, pinned_client_context
from swarmd.transport.links import PROTOCOL
from swarmd.transport.transport import Send, TransportConfig
from swarmd.wire import Ack, Error, Forward, Hello, Token, WireTensor, decode, encode
from swarmd.wire.expect import ExpectForward
from tests.transport.conftest import eventually, introduce

HIDDEN = 576
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # real hosts: about a second each


def fwd(step: int, request_id: str = "req", rows: int = 1, width: int = HIDDEN, dtype=np.float32) -> Forward:
    hidden = np.full((rows, width), step, dtype=dtype)
    return Forward(request_id, step, 1, step, "head", hidden=WireTensor.from_array(hidden))


class Counts:
    """A handler counting deliveries per key (a KV cache would append once per delivery)."""

    def __init__(self, reply_to: str | None = None, delay: float = 0.0) -> None:
        self.by_key: dict = {}
        self.reply_to, self.delay = reply_to, delay
        self.changed = trio.Event()

    async def __call__(self, peer, msg):
        self.by_key[msg.key()] = self.by_key.get(msg.key(), 0) + 1
        self.changed.set()
        self.changed = trio.Event()
        if self.delay:
            await trio.sleep(self.delay)
        if self.reply_to:
            return Send(self.reply_to, Token(msg.request_id, msg.step, msg.step, hop=1))
        return None

    async def wait_for(self, n: int, seconds: float = 10.0) -> None:
        with trio.fail_after(seconds):
            while len(self.by_key) < n:
                await self.changed.wait()


async def frame_of(stream):
    return decode(await read_frame(stream, 1 << 20))


@pytest.mark.parametrize("tls", [False, True])
async def test_frames_flow_down_a_chain_and_results_come_back(p2p, tls):
    a, b, c = [await p2p(seed, tls=tls) for seed in (1, 2, 3)]

    async def stage_b(peer, msg):  # what a middle stage does: pass a result on to the next hop
        return Send(c.peer, Forward(msg.request_id, msg.step, 2, msg.start_pos, msg.head, hidden=msg.hidden))

    b.transport.route(Forward, stage_b)
    c_got, tokens = Counts(reply_to=a.peer), Counts()
    c.transport.route(Forward, c_got)
    a.transport.route(Token, tokens)
    for step in range(20):
        await a.transport.send(b.peer, fwd(step))
    await tokens.wait_for(20)
    assert set(c_got.by_key.values()) == {1} and len(c_got.by_key) == 20
    path = LinkPath.DATA_PLANE if tls else LinkPath.DIRECT
    assert a.network.link_paths()[b.peer].path is path and b.network.link_paths()[c.peer].path is path
    if tls:  # the frames went over pinned TLS connections, one per neighbour
        assert b.network.data_plane is not None and c.network.data_plane is not None
        assert b.network.data_plane.connections(a.peer) == 1 and c.network.data_plane.connections(b.peer) == 1


@pytest.mark.parametrize("tls", [False, True])
async def test_a_connection_reset_mid_transfer_is_retried_and_delivered_exactly_once(p2p, tls):
    cfg = TransportConfig(window=8, max_handlers_per_peer=2)  # frames queue unacked at b: some are in flight
    a, b = await p2p(1, tls=tls, config=cfg), await p2p(2, tls=tls, config=cfg)
    got = Counts(delay=0.01)  # 2 handlers of 10 ms: b admits 200 frames/s, a offers 500/s, so acks lag
    b.transport.route(Forward, got)

    async def reset_connections():
        await got.wait_for(1)  # mid-transfer: the link is up (its first open may take a while on a busy machine)
        for _ in range(3):
            await trio.sleep(0.15)
            await b.network._disconnect(a.peer)  # closes the libp2p connection and any data-plane socket

    n = 150
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reset_connections)
        for step in range(n):
            nursery.start_soon(a.transport.send, b.peer, fwd(step, rows=16))
            await trio.sleep(0.002)
    await got.wait_for(n)
    assert sorted(got.by_key) == sorted(fwd(s).key() for s in range(n))
    assert set(got.by_key.values()) == {1}  # exactly once, although frames were resent
    assert a.transport.stats.reconnects >= 1 and a.transport.stats.resent >= 1


async def raw_link(mallory, target) -> Libp2pStream:
    """A stream into `target`'s transport from a host that writes frames by hand."""
    from libp2p.peer.id import ID

    introduce(mallory, [target.host])
    stream = Libp2pStream(await mallory.new_stream(ID.from_base58(target.peer), [PROTOCOL]))
    await stream.write(encode(Hello(1 << 20)))
    assert isinstance((await frame_of(stream)).msg, Hello)
    return stream


async def answer(stream, body: bytes):
    await write_frame(stream, body)
    with trio.fail_after(5):
        return await frame_of(stream)


async def test_bad_frames_get_clear_errors_and_the_daemon_survives(p2p, bare_host):
    a = await p2p(1)
    b = await p2p(2, config=TransportConfig(max_frame=1 << 20))
    got = Counts()
    b.transport.route(Forward, got, expect=ExpectForward(hop=1, hidden_size=HIDDEN, vocab_size=49152))
    stream = await raw_link(await bare_host(9), b)
    cases = [
        (b"\x00\x01 not cbor", "not_cbor"),
        (cbor2.dumps({"t": "teleport", "v": 1, "seq": 2, "body": {}}), "unknown_type"),
        (encode(fwd(3, width=HIDDEN - 1), 3)[4:], "bad_shape"),
        (encode(fwd(4, dtype=np.float16), 4)[4:], "bad_dtype"),
    ]
    for body, code in cases:
        reply = await answer(stream, body)
        assert isinstance(reply.msg, Error) and reply.msg.code == code, reply
    assert (await answer(stream, encode(fwd(5), 5)[4:])).msg == Ack()  # the same link still works
    await stream.write(HEADER.pack((1 << 20) + 1))  # over the size limit: refused from its header
    with trio.fail_after(5):
        assert (await frame_of(stream)).msg.code == "frame_too_large"
    await a.transport.send(b.peer, fwd(6))  # and the daemon serves others
    assert set(got.by_key) == {fwd(5).key(), fwd(6).key()}


async def test_duplicated_and_reordered_frames_are_delivered_once_each(p2p, bare_host):
    b = await p2p(2)
    got = Counts()
    b.transport.route(Forward, got)
    stream = await raw_link(await bare_host(9), b)
    order = [3, 1, 3, 2, 1, 1, 2]
    for seq, step in enumerate(order, start=1):
        await stream.write(encode(fwd(step), seq))
    with trio.fail_after(5):
        acks = [await frame_of(stream) for _ in order]
    assert sorted(env.seq for env in acks if env.msg == Ack()) == list(range(1, len(order) + 1))
    assert got.by_key == {fwd(s).key(): 1 for s in (1, 2, 3)}
    assert b.transport.stats.duplicates == 4


async def test_a_peer_that_keeps_sending_bad_frames_is_disconnected(p2p, bare_host):
    b = await p2p(2)
    b.network.gate.limits = GuardLimits(bad_frames=3)
    mallory = await bare_host(9)
    stream = await raw_link(mallory, b)
    codes = [(await answer(stream, b"\xff" * 8)).msg.code for _ in range(4)]
    assert codes == ["not_cbor"] * 4
    with trio.fail_after(5):
        assert (await frame_of(stream)).msg.code == "penalised"
    await eventually(lambda: not mallory.get_network().get_connections(b.host.get_id()))
    assert b.network.gate.is_penalised(str(mallory.get_id()), trio.current_time())


async def test_garbage_instead_of_hello_closes_the_stream_and_nothing_else(p2p, bare_host):
    from libp2p.peer.id import ID

    a, b = await p2p(1), await p2p(2)
    got = Counts()
    b.transport.route(Forward, got)
    mallory = await bare_host(9)
    introduce(mallory, [b.host])
    stream = Libp2pStream(await mallory.new_stream(ID.from_base58(b.peer), [PROTOCOL]))
    await stream.write(HEADER.pack(3) + b"abc")
    with trio.fail_after(5):
        assert await stream.read(100) == b""
    await a.transport.send(b.peer, fwd(1))
    assert got.by_key == {fwd(1).key(): 1}


async def test_a_flood_from_one_peer_does_not_stop_the_others(p2p):
    cfg = TransportConfig(frames_per_second=300, frame_burst=50, max_handlers_per_peer=4)
    a, b, flooder = await p2p(1, config=cfg), await p2p(2, config=cfg), await p2p(3, config=cfg)
    got = Counts()
    b.transport.route(Forward, got)
    flood_started = 0.0

    async def flood():
        nonlocal flood_started
        flood_started = trio.current_time()
        for step in range(100_000):
            await flooder.transport.post(b.peer, fwd(step, request_id="flood"))

    latencies = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood)
        await trio.sleep(0.5)  # the flood is in full swing
        for step in range(10):
            start = trio.current_time()
            await a.transport.send(b.peer, fwd(step, request_id="honest"), within=5)
            latencies.append(trio.current_time() - start)
        nursery.cancel_scope.cancel()
    flood_seconds = trio.current_time() - flood_started
    honest = [k for k in got.by_key if k[1] == "honest"]
    assert len(honest) == 10
    assert max(latencies) < 1.0, latencies
    flooded = sum(1 for k in got.by_key if k[1] == "flood")
    assert cfg.frame_burst < flooded <= cfg.frame_burst + cfg.frames_per_second * flood_seconds + 1  # held to its rate


async def test_a_data_plane_certificate_that_does_not_match_the_pin_is_not_used(p2p):
    a, b = await p2p(1, tls=True), await p2p(2, tls=True)
    got = Counts()
    b.transport.route(Forward, got)
    plane = b.network.data_plane
    assert plane is not None
    honest_offer = plane.offer
    impostor_cert, _ = make_certificate("impostor")

    def forged_offer(peer, protocol):  # the offer pins a certificate the TLS listener does not hold
        offer = honest_offer(peer, protocol)
        return type(offer)(offer.host, offer.port, impostor_cert, offer.token)

    plane.offer = forged_offer
    await a.transport.send(b.peer, fwd(1))
    path = a.network.link_paths()[b.peer]  # refused the TLS connection, delivered over libp2p instead
    assert path.path is LinkPath.DIRECT and "data plane failed" in path.reason
    assert got.by_key == {fwd(1).key(): 1}


async def test_the_data_plane_admits_only_connections_with_a_token_handed_out_over_libp2p(p2p):
    a, b = await p2p(1, tls=True), await p2p(2, tls=True)
    got = Counts()
    b.transport.route(Forward, got)
    plane = b.network.data_plane
    assert plane is not None

    plain = await trio.open_tcp_stream("127.0.0.1", plane.port)  # not even TLS
    await plain.send_all(b"GET / HTTP/1.0\r\n\r\n")
    with trio.fail_after(5):
        assert await plain.receive_some(100) == b""

    tcp = await trio.open_tcp_stream("127.0.0.1", plane.port)  # TLS, but a token nobody handed out
    tls = trio.SSLStream(tcp, pinned_client_context(plane.cert_der))
    stream = TrioStream(tls)
    await write_frame(stream, b"forged-token-123")
    with trio.fail_after(5), pytest.raises(StreamClosed):
        await read_frame(stream, 4096)

    await a.transport.send(b.peer, fwd(1))
    assert got.by_key == {fwd(1).key(): 1} and plane.connections(a.peer) == 1


@pytest.mark.parametrize("tls", [False, True])
async def test_the_hot_lane_runs_steps_on_a_data_plane_thread_and_keeps_libp2p_paths_on_the_event_loop(p2p, tls):
    import threading

    from swarmd.transport.lane import HotLane

    a, b = [await p2p(seed, tls=tls) for seed in (1, 2)]
    async with trio.open_nursery() as nursery:
        lane_a = await nursery.start(HotLane(a.network, a.transport).run)
        lane_b = await nursery.start(HotLane(b.network, b.transport).run)
        threads: list[str] = []

        def hot(peer, msg, reply):
            threads.append(threading.current_thread().name)
            return Send(peer, Token(msg.request_id, msg.step, msg.step, hop=1))

        b.transport.route(Forward, Counts(reply_to=a.peer))
        lane_b.route(Forward, hot)
        tokens = Counts()
        a.transport.route(Token, tokens)
        step = 0
        with trio.fail_after(20):
            while step < 30 or (tls and lane_b.stats.sent < 5):  # (b opens its lane to a on its first answer)
                if not lane_a.send(b.peer, fwd(step)):
                    await a.transport.post(b.peer, fwd(step))
                step += 1
                await tokens.wait_for(step)
        await eventually(lambda: lane_a.status()["lanes"] and all(
            v["unacked"] == 0 for v in lane_a.status()["lanes"].values()))
        if tls:  # the steps ran on the TLS stream's own thread, and the answers came back on b's lane
            assert len(threads) >= 25 and set(threads) == {"swarmd-link"}
            assert lane_b.stats.sent >= 5 and lane_a.stats.acked >= 25
        else:  # libp2p streams cannot leave the event loop: the transport carried everything
            assert threads == [] and "no data plane" in next(iter(lane_a.status()["lanes"].values()))["last_error"]
        assert len(tokens.by_key) == step
        nursery.cancel_scope.cancel()
