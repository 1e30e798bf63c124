"""The actor transport over in-memory streams, in virtual time (trio's MockClock jumps over every wait)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing

from swarmd.errors import RemoteProtocolError
from swarmd.net.framing import HEADER
from swarmd.net.gate import GuardLimits
from swarmd.net.seam import PeerUnreachable, Stream, StreamClosed
from swarmd.net.streams import TrioStream, read_frame
from swarmd.transport.transport import DeliveryFailed, Posted, Refused, Send, TransportConfig
from swarmd.wire import (
    Ack,
    Cancel,
    Error,
    ExpertBatch,
    Forward,
    Hello,
    Ping,
    Pong,
    Token,
    WireTensor,
    decode,
    encode,
)
from swarmd.wire.expect import ExpectForward
from tests.transport.memnet import MemoryNet

HIDDEN = 8


def fwd(step: int, request_id: str = "req", width: int = HIDDEN) -> Forward:
    row = np.full((1, width), step, dtype=np.float32)
    return Forward(request_id, step, 1, step, "head", hidden=WireTensor.from_array(row))


class Recorder:
    """A handler that records what it was given (and can be made slow or to reply)."""

    def __init__(self, reply_to: str | None = None) -> None:
        self.got: list[tuple[str, object]] = []
        self.arrived = trio.Event()
        self.gate: trio.Event | None = None
        self.reply_to = reply_to

    async def __call__(self, peer, msg):
        self.got.append((peer, msg))
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.reply_to is not None:
            return Send(self.reply_to, Token(msg.request_id, msg.step, 100 + msg.step))
        return None

    @property
    def keys(self):
        return [m.key() for _, m in self.got]


@pytest.fixture
async def net(nursery):
    return MemoryNet(nursery)


async def test_send_returns_once_the_receiver_has_the_message(net, autojump_clock):
    a, b = await net.add("a"), await net.add("b")
    got = Recorder()
    b.route(Forward, got)
    await a.send("b", fwd(1))
    await trio.lowlevel.checkpoint()
    assert got.got == [("a", fwd(1))]
    assert a.stats.sent == 1 and b.stats.delivered == 1


async def test_what_a_handler_returns_is_delivered_to_the_peer_it_names(net, autojump_clock):
    a, b = await net.add("a"), await net.add("b")
    b.route(Forward, Recorder(reply_to="a"))
    tokens = Recorder()
    a.route(Token, tokens)
    await a.send("b", fwd(3))
    with trio.fail_after(5):
        await tokens.arrived.wait()
    assert tokens.got == [("b", Token("req", 3, 103))]


class LoseFirstAck:
    """The sender's side of a link whose first answer after the hello is lost with the connection."""

    HELLO = len(encode(Hello(TransportConfig().max_frame)))

    def __init__(self, stream):
        self.stream, self.received = stream, 0

    async def read(self, n):
        data = await self.stream.read(n)
        if self.received >= self.HELLO and data and self.received < 1 << 62:  # the peer's hello came whole
            self.received = 1 << 62
            await self.stream.reset()
            raise StreamClosed("connection reset")
        self.received += len(data)
        return data

    async def write(self, data):
        await self.stream.write(data)

    async def close(self):
        await self.stream.close()


async def test_a_frame_whose_ack_was_lost_is_resent_and_acked_but_delivered_once(net, autojump_clock):
    a, b = await net.add("a"), await net.add("b")
    got = Recorder()
    b.route(Forward, got)
    net.wrap = lambda src, dst, s: LoseFirstAck(s) if net.dials[(src, dst)] == 1 else s
    await a.send("b", fwd(1))
    assert got.keys == [fwd(1).key()]
    assert net.dials[("a", "b")] == 2
    assert a.stats.resent == 1 and b.stats.duplicates == 1


async def test_links_broken_again_and_again_still_deliver_every_message_exactly_once(net, autojump_clock):
    cfg = TransportConfig(window=8, max_handlers_per_peer=2)  # few handlers: frames wait unacked, in flight
    a, b = await net.add("a", cfg), await net.add("b", cfg)
    got = Recorder()

    async def slow_handler(peer, msg):
        await trio.sleep(0.003)
        return await got(peer, msg)

    b.route(Forward, slow_handler)

    async def chaos():
        for _ in range(15):
            await trio.sleep(0.004)
            await net.break_links()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(chaos)
        for step in range(200):
            nursery.start_soon(a.send, "b", fwd(step))
            await trio.sleep(0.0005)
    await trio.sleep(0.1)  # acked on admission: let the last handlers finish
    assert sorted(got.keys) == sorted(fwd(s).key() for s in range(200))
    assert a.stats.sent == 200
    assert a.stats.reconnects >= 3 and a.stats.resent > 0


async def test_duplicate_and_reordered_frames_are_acked_each_and_delivered_once(net, autojump_clock):
    await net.add("a")
    b = await net.add("b")
    got = Recorder()
    b.route(Forward, got)
    link = await net.raw_link("a", "b")
    order = [1, 2, 1, 3, 2, 3, 1]
    for seq, step in enumerate(order, start=1):
        await link.send(fwd(step), seq)
    acks = [await link.reply() for _ in order]
    assert all(isinstance(env.msg, Ack) for env in acks)
    assert sorted(env.seq for env in acks) == list(range(1, len(order) + 1))
    # handlers run concurrently, so in any order: each step once
    assert sorted(got.keys) == [fwd(1).key(), fwd(2).key(), fwd(3).key()]
    assert b.stats.duplicates == 4


async def test_a_duplicate_after_the_handler_finished_replays_its_cached_result(net, autojump_clock):
    await net.add("a")
    b, c = await net.add("b"), await net.add("c")
    b_got, c_got = Recorder(reply_to="c"), Recorder()
    b.route(Forward, b_got)
    c.route(Token, c_got)
    link = await net.raw_link("a", "b")
    await link.send(fwd(5), 1)
    assert isinstance((await link.reply()).msg, Ack)
    await trio.sleep(1)
    await link.send(fwd(5), 2)  # as if a's retry crossed the first ack
    assert isinstance((await link.reply()).msg, Ack)
    await trio.sleep(1)
    assert len(b_got.got) == 1  # computed once
    assert b.stats.replays == 1  # its output sent again
    assert c.stats.duplicates == 1 and len(c_got.got) == 1  # and the next hop delivered it once


async def test_a_slow_receiver_slows_the_sender_and_nothing_piles_up(net, autojump_clock):
    cfg = TransportConfig(window=4, max_handlers_per_peer=2)
    a, b = await net.add("a", cfg), await net.add("b", cfg)
    got = Recorder()
    got.gate = trio.Event()
    b.route(Forward, got)
    posted = 0

    async def producer():
        nonlocal posted
        for step in range(50):
            await a.post("b", fwd(step), within=300)
            posted += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        await trio.sleep(30)  # long past the ack timeout: the link must stay up on pings alone
        assert len(got.got) == 2  # the per-peer handler limit
        assert posted == 2 + 4  # two acked and running, a window of four waiting
        assert a.link_state()["b"]["unacked"] == 4
        assert a.stats.reconnects == 0
        got.gate.set()
    await trio.sleep(1)
    assert len(got.got) == 50 and a.stats.sent == 50


async def test_an_unreachable_peer_fails_the_send_at_its_deadline_after_spaced_out_retries(net, autojump_clock):
    a = await net.add("a")
    await net.add("b")
    net.down.add("b")
    start = trio.current_time()
    with pytest.raises(DeliveryFailed, match="connection refused"):
        await a.send("b", fwd(1), within=5.0)
    assert trio.current_time() - start == pytest.approx(5.0, abs=0.01)
    gaps = np.diff(net.dial_times)
    assert 5 <= len(net.dial_times) <= 15
    assert all(later >= earlier * 0.99 for earlier, later in itertools.pairwise(gaps))
    assert a.stats.expired == 1


async def test_a_peer_that_comes_back_gets_the_message(net, autojump_clock):
    a, b = await net.add("a"), await net.add("b")
    got = Recorder()
    b.route(Forward, got)
    net.down.add("b")

    async def revive():
        await trio.sleep(1.5)
        net.down.discard("b")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(revive)
        await a.send("b", fwd(1), within=10)
    assert got.keys == [fwd(1).key()]
    assert trio.current_time() < 5


async def test_a_hung_peer_is_pinged_declared_dead_and_the_link_reopened(net, autojump_clock):
    cfg = TransportConfig(ack_timeout=1.0)
    a, b = await net.add("a", cfg), await net.add("b", cfg)
    got = Recorder()
    b.route(Forward, got)
    await a.send("b", fwd(0))  # the link is up
    net.hub.black_hole("a", "b")  # from now on nothing on it arrives, and neither side is told

    async def recover():
        await trio.sleep(0.5)
        net.hub.mend("a", "b")

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recover)
        await a.send("b", fwd(1))
    assert got.keys == [fwd(0).key(), fwd(1).key()]
    assert 2.0 <= trio.current_time() - start < 3.0  # ack timeout, then a ping that got no answer either
    assert net.dials[("a", "b")] == 2


async def test_bad_frames_get_error_replies_and_a_persistent_offender_is_cut_off(net, autojump_clock):
    alice, b = await net.add("alice"), await net.add("b")
    gate = net.endpoints["b"].gate
    gate.limits = GuardLimits(bad_frames=3)
    got = Recorder()
    b.route(Forward, got)
    b.route(Token, got)
    link = await net.raw_link("mallory", "b")
    bad = [b"\xff", b"\x01\x02", encode(Ping(), 1)[4:-1], encode(Pong(), 9)[4:]]
    codes = []
    for body in bad:
        await link.write(HEADER.pack(len(body)) + body)
        codes.append((await link.reply()).msg.code)
    assert codes == ["not_cbor", "not_cbor", "not_cbor", "unexpected"]
    final = await link.reply()
    assert final.msg.code == "penalised"
    assert await link.reply() is None  # and the link is closed
    assert gate.is_penalised("mallory", trio.current_time()) and b.stats.penalised == 1
    with pytest.raises(PeerUnreachable):  # refused while the penalty lasts
        await net.raw_link("mallory", "b")
    await alice.send("b", fwd(1))  # others are served as before
    assert got.keys == [fwd(1).key()]
    await trio.sleep(gate.limits.penalty)
    assert not gate.is_penalised("mallory", trio.current_time())


async def test_an_oversized_frame_gets_an_error_and_the_link_is_closed(net, autojump_clock):
    b = await net.add("b", TransportConfig(max_frame=1024))
    b.route(Forward, Recorder())
    link = await net.raw_link("a", "b")
    await link.write(HEADER.pack(1 << 30))
    reply = await link.reply()
    assert isinstance(reply.msg, Error) and reply.msg.code == "frame_too_large"
    assert await link.reply() is None
    assert b.running


async def test_what_the_receiver_does_not_expect_is_refused_to_the_sender(net, autojump_clock):
    a, b = await net.add("a"), await net.add("b")
    got = Recorder()
    b.route(Forward, got, expect=ExpectForward(hop=1, hidden_size=HIDDEN, vocab_size=100))
    with pytest.raises(Refused) as info:
        await a.send("b", fwd(1, width=HIDDEN * 2))
    assert info.value.error.code == "bad_shape" and info.value.error.request_id == "req"
    with pytest.raises(Refused) as info:
        await a.send("b", ExpertBatch("b1", 0, 0, *(WireTensor.from_array(np.zeros((1, 1), t)) for t in
                                                     (np.float32, np.int32, np.float32))))
    assert info.value.error.code == "unhandled"
    await a.send("b", fwd(2))
    assert got.keys == [fwd(2).key()]


async def test_a_failing_handler_answers_with_an_error_message_and_the_daemon_carries_on(net, autojump_clock):
    a, b = await net.add("a"), await net.add("b")
    errors = Recorder()
    a.route(Error, errors)

    async def handler(peer, msg):
        if msg.step == 1:
            raise ValueError("boom")
        if msg.step == 2:
            raise RemoteProtocolError("step 2 is out of order")
        return Send(peer, Token(msg.request_id, msg.step, 1))

    tokens = Recorder()
    a.route(Token, tokens)
    b.route(Forward, handler)
    for step in (1, 2, 3):
        await a.send("b", fwd(step))
    await trio.sleep(1)
    # the handlers run concurrently: their answers come in either order
    answers = sorted((e.step, e.code, e.request_id, e.message) for _, e in errors.got)
    assert [a[:3] for a in answers] == [(1, "internal", "req"), (2, "bad_request", "req")]
    assert "ValueError" in answers[0][3]
    assert [m.step for _, m in tokens.got] == [3]
    assert b.stats.handler_errors == 1


async def test_a_frame_admitted_as_the_transport_stops_ends_its_link_not_the_daemon(net, autojump_clock, caplog):
    # The daemon stops while its last handler finishes. The frame waiting for that handler's slot is admitted
    # just as the transport's nursery closes (before or after the transport has seen it close, in either
    # order): it is neither handled nor acked, its link closes, and nothing is logged as an error.
    await net.add("a")
    release, handled = trio.Event(), []

    async def finishing(peer, msg):
        handled.append(msg.key())
        with trio.CancelScope(shield=True):
            await release.wait()

    async def daemon(*, task_status=trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as tasks:
            b = await net.add("b", TransportConfig(max_handlers_per_peer=1), nursery=tasks)
            b.route(Forward, finishing)
            task_status.started((b, tasks.cancel_scope))

    b, stop = await net.nursery.start(daemon)
    link = await net.raw_link("a", "b")
    await link.send(fwd(1), 1)
    assert (await link.reply()).seq == 1
    stop.cancel()
    await trio.sleep(0.01)
    assert b.running  # its nursery waits for the finishing handler
    await link.send(fwd(2), 2)  # waits for the handler's slot
    await trio.sleep(0.01)
    release.set()
    assert await link.reply() is None  # closed, not acked
    assert not b.running
    assert handled == [fwd(1).key()] and b.stats.delivered == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_after_a_cancel_late_frames_of_that_request_are_dropped(net, autojump_clock):
    a, b = await net.add("a"), await net.add("b")
    got = Recorder()
    b.route(Forward, got)
    b.route(Cancel, got)
    await a.send("b", fwd(1))
    await a.send("b", Cancel("req"))
    await a.send("b", fwd(2))  # a straggler: acked, never handled
    await a.send("b", fwd(2, request_id="other"))
    assert [m.TAG + ":" + m.request_id for _, m in got.got] == ["forward:req", "cancel:req", "forward:other"]
    assert b.stats.dropped_closed == 1


async def test_a_sender_ignoring_the_window_is_cut_short(net, autojump_clock):
    b = await net.add("b", TransportConfig(window=4, max_handlers_per_peer=1))
    got = Recorder()
    got.gate = trio.Event()
    b.route(Forward, got)
    link = await net.raw_link("a", "b")
    for seq in range(1, 10):
        await link.send(fwd(seq), seq)
    replies = []
    while (env := await link.reply()) is not None:
        replies.append(env)
    assert [e.msg.code for e in replies if isinstance(e.msg, Error)] == ["window_exceeded"]
    assert len(replies) <= 3  # at most one ack (the single handler slot) and the error
    got.gate.set()


async def test_unacked_bytes_are_bounded_too_and_a_big_frame_travels_alone(net, autojump_clock):
    frame_size = len(encode(fwd(0)))
    cfg = TransportConfig(window_bytes=4 * frame_size + 10, max_handlers_per_peer=1)
    a, b = await net.add("a", cfg), await net.add("b", cfg)
    got = Recorder()
    got.gate = trio.Event()
    b.route(Forward, got)
    posted = 0

    async def producer():
        nonlocal posted
        for step in range(20):
            await a.post("b", fwd(step), within=300)
            posted += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        await trio.sleep(5)
        assert posted == 1 + 4  # one running, four frames' worth of bytes unacked
        assert a.link_state()["b"]["unacked"] == 4
        got.gate.set()
    await a.send("b", fwd(99, width=HIDDEN * 100), within=10)  # larger than the byte window: sent alone
    await trio.sleep(1)
    assert len(got.got) == 21


async def test_a_sender_ignoring_the_byte_window_is_cut_short(net, autojump_clock):
    frame_size = len(encode(fwd(0)))
    b = await net.add("b", TransportConfig(window_bytes=2 * frame_size, max_frame=3 * frame_size,
                                           max_handlers_per_peer=1))
    got = Recorder()
    got.gate = trio.Event()
    b.route(Forward, got)
    link = await net.raw_link("a", "b")
    for seq in range(1, 7):  # one admitted, one at the dispatcher, three fit the buffer, the sixth does not
        await link.send(fwd(seq), seq)
    replies = []
    while (env := await link.reply()) is not None:
        replies.append(env)
    assert [e.msg.code for e in replies if isinstance(e.msg, Error)] == ["window_exceeded"]
    assert [e.seq for e in replies if isinstance(e.msg, Ack)] == [1]
    got.gate.set()


async def test_a_message_to_this_daemon_is_handed_over_in_process_with_the_same_checks(net, autojump_clock):
    a = await net.add("a")
    got = Recorder()
    a.route(Forward, got, expect=ExpectForward(hop=1, hidden_size=HIDDEN, vocab_size=100))
    await a.send("a", fwd(1))
    await a.post("a", fwd(1))  # a duplicate: not handled twice
    await trio.lowlevel.checkpoint()
    assert got.keys == [fwd(1).key()]
    assert net.dials[("a", "a")] == 0 and a.stats.duplicates == 1
    with pytest.raises(Refused) as info:
        await a.send("a", fwd(2, width=HIDDEN + 1))
    assert info.value.error.code == "bad_shape"
    with pytest.raises(Refused, match="unhandled"):
        await a.send("a", Token("req", 0, 1))


class WriteTap:
    """One end of a link, telling `on_write` of each write the transport makes on it."""

    def __init__(self, stream: Stream, on_write: Callable[[bytes], None]) -> None:
        self.stream, self.on_write = stream, on_write

    async def read(self, max_bytes: int) -> bytes:
        return await self.stream.read(max_bytes)

    async def write(self, data: bytes) -> None:
        self.on_write(data)
        await self.stream.write(data)

    async def close(self) -> None:
        await self.stream.close()

    async def reset(self) -> None:
        await self.stream.reset()


async def test_the_handlers_a_read_started_begin_before_its_acks_are_written(net, autojump_clock):
    b = await net.add("b")
    events: list[str] = []

    async def handler(peer, msg):
        events.append(f"handler {msg.step} began")

    b.route(Forward, handler)
    near, far = trio.testing.memory_stream_pair()
    net.nursery.start_soon(b.serve, "a", WriteTap(TrioStream(far), lambda data: events.append("ack written")))
    sender = TrioStream(near)
    await sender.write(encode(fwd(1), 1) + encode(fwd(2), 2))  # one read, two frames
    acks = [decode(await read_frame(sender, 1 << 20)) for _ in range(2)]
    assert [(e.seq, type(e.msg)) for e in acks] == [(1, Ack), (2, Ack)]
    assert sorted(events[:2]) == ["handler 1 began", "handler 2 began"]  # in either order (trio's choice)
    assert events[2:] == ["ack written"]  # both acks in one write, after the handlers began


def _frames_in(data: bytes) -> int:
    """How many frames one write carried."""
    n = 0
    while data:
        (size,) = HEADER.unpack(data[:HEADER.size])
        data = data[HEADER.size + size:]
        n += 1
    return n


async def test_messages_posted_together_leave_in_one_write_and_are_each_delivered_and_acked(net, autojump_clock):
    writes: list[int] = []
    net.wrap = lambda src, dst, stream: WriteTap(stream, lambda data: writes.append(_frames_in(data)))
    a, b = await net.add("a"), await net.add("b")
    got = Recorder()
    b.route(Forward, got)
    await a.send("b", fwd(0))  # the link is up and idle now
    await a.post_all([Send("b", fwd(1)), Send("b", fwd(2)), Send("b", fwd(3))])
    assert writes[-2:] == [1, 3]  # after the link's hello: the first frame alone, then the three together
    await trio.sleep(1)
    assert sorted(got.keys) == [fwd(step).key() for step in range(4)]
    assert a.stats.sent == 4 and not a.link_state()["b"]["unacked"]


async def test_a_result_the_handler_posted_itself_is_not_posted_again_but_is_replayed_to_a_duplicate(net, autojump_clock):
    await net.add("a")
    b, c = await net.add("b"), await net.add("c")
    c_got = Recorder()
    c.route(Token, c_got)
    computed = []

    async def posts_itself(peer, msg):
        computed.append(msg.key())
        sends = (Send("c", Token(msg.request_id, msg.step, 100 + msg.step)),)
        await b.post_all(sends)
        return Posted(sends)

    b.route(Forward, posts_itself)
    link = await net.raw_link("a", "b")
    await link.send(fwd(5), 1)
    assert isinstance((await link.reply()).msg, Ack)
    await trio.sleep(1)
    assert c_got.got == [("b", Token("req", 5, 105))] and c.stats.duplicates == 0  # posted once
    await link.send(fwd(5), 2)  # as if a's retry crossed the first ack
    assert isinstance((await link.reply()).msg, Ack)
    await trio.sleep(1)
    assert computed == [fwd(5).key()] and b.stats.replays == 1  # computed once, its result sent again
    assert c.stats.duplicates == 1 and len(c_got.got) == 1
