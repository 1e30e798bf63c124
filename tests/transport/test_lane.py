"""The hot lane on the in-memory network, in virtual time: messages run on the lane's reader, answers go back on
the lane, and whatever the lane cannot carry (not open yet, declined, a broken stream) is carried by the
actor transport, each message handled once."""

from __future__ import annotations

import numpy as np
import trio

from swarmd.net.framing import HEADER
from swarmd.net.seam import detachable
from swarmd.transport.lane import DECLINE, LANE_PROTOCOL, LATER, Ahead, HotLane, Known, Taken
from swarmd.transport.transport import Send
from swarmd.wire import Error, Forward, Hello, Token, WireTensor, decode, encode
from swarmd.wire.binary import decode_body, encode_frame
from swarmd.wire.expect import ExpectForward
from swarmd.wire.follow import Follower, NextForward, NextToken
from tests.transport.memnet import MemoryNet

HIDDEN = 8


def fwd(step: int, request_id: str = "req") -> Forward:
    return Forward(request_id, step, 1, step, "head", hidden=WireTensor.from_array(np.full((1, HIDDEN), step, np.float32)))


class Pair:
    """Daemons a and b with a transport and a lane each: b runs Forwards (hot, or on its event loop) and
    answers a with a Token per step."""

    def __init__(self, net: MemoryNet) -> None:
        self.net = net
        self.hot: list[int] = []  # steps b ran on its lane's reader
        self.loop: list[int] = []  # steps b's transport handler ran
        self.tokens: list[int] = []  # steps a got a Token for
        self.decide = lambda msg: None  # b's hot handler: None = run it, else what to answer

    async def start(self, nursery: trio.Nursery) -> None:
        self.a = await self.net.add("a")
        self.b = await self.net.add("b")
        self.lane_a = await nursery.start(HotLane(self.net.endpoints["a"], self.a).run)
        self.lane_b = await nursery.start(HotLane(self.net.endpoints["b"], self.b).run)

        def hot(peer, msg, reply):
            verdict = self.decide(msg)
            if verdict is not None:
                return verdict
            self.hot.append(msg.step)
            return Send(peer, Token(msg.request_id, msg.step, 100 + msg.step))

        async def on_loop(peer, msg):
            self.loop.append(msg.step)
            return Send(peer, Token(msg.request_id, msg.step, 100 + msg.step))

        async def on_token(peer, msg):
            self.tokens.append(msg.step)

        self.b.route(Forward, on_loop, expect=ExpectForward(hop=1, hidden_size=HIDDEN, vocab_size=10))
        self.lane_b.route(Forward, hot)
        self.a.route(Token, on_token)

    async def send(self, step: int) -> None:
        if not self.lane_a.send("b", fwd(step)):
            await self.a.post("b", fwd(step))

    async def until(self, n: int) -> None:
        with trio.fail_after(30):
            while len(self.tokens) < n:  # noqa: ASYNC110 - handlers append as frames land
                await trio.sleep(0.01)


async def test_once_the_lane_is_open_steps_run_on_its_reader_and_their_answers_come_back_on_it(nursery,
                                                                                              autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    await p.send(0)  # no lane yet: the transport carries it, and the lane opens meanwhile
    await p.until(1)
    for step in range(1, 6):
        await p.send(step)
        await p.until(step + 1)
    assert p.loop == [0] and p.hot == [1, 2, 3, 4, 5] and p.tokens == [0, 1, 2, 3, 4, 5]
    assert p.lane_b.stats.hot == 5 and p.lane_a.stats.acked == 0  # acks are gathered, not written between steps
    await trio.sleep(p.lane_b.config.ack_delay)
    assert p.lane_a.stats.acked == 5  # and then every lane frame was acked
    assert p.lane_b.stats.sent >= 4  # the answers went back on b's own lane to a


async def test_the_transports_observer_hears_every_lane_frame_sent_acked_and_received(nursery, autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    sent: list[tuple[int, str, int]] = []
    settled: list[tuple[int, bool]] = []
    received: list[tuple[str, int]] = []

    class Observer:
        def now(self) -> float:
            return 0.0

        def encoded(self, peer, seq, msg, started, nbytes) -> None:
            sent.append((seq, msg.TAG, nbytes))

        def settled(self, peer, seq, acked) -> None:
            settled.append((seq, acked))

        def decoded(self, peer, msg, started, nbytes) -> None:
            received.append((msg.TAG, nbytes))

        def handling(self, msg) -> None:
            pass

    p.a.observer = Observer()
    p.b.observer = Observer()
    await p.send(0)  # by the transport: the lane opens meanwhile
    await p.until(1)
    for step in range(1, 4):
        await p.send(step)
        await p.until(step + 1)
    await trio.sleep(1)  # the acks gathered on the lanes go back
    lane_sent = [(seq, tag) for seq, tag, n in sent if seq < 0]  # the lane numbers its frames on its own
    assert ("forward" in {tag for _, tag in lane_sent}) and ("token" in {tag for _, tag in lane_sent})
    assert all(n > 0 for _, _, n in sent)
    assert sorted(seq for seq, _ in lane_sent) == sorted(seq for seq, acked in settled if seq < 0 and acked)
    assert [tag for tag, _ in received].count("forward") == 4 and [tag for tag, _ in received].count("token") == 4


async def test_a_declined_step_runs_on_the_event_loop_and_is_acked_once_admitted(nursery, autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    await p.send(0)
    await p.until(1)
    p.decide = lambda msg: DECLINE if msg.step == 2 else None
    for step in (1, 2, 3):
        await p.send(step)
        await p.until(step + 1)
    assert p.hot == [1, 3] and p.loop == [0, 2]
    await trio.sleep(1)
    assert p.lane_a.status()["lanes"]["b"]["unacked"] == 0


async def test_a_later_answer_is_sent_and_acked_when_it_is_given(nursery, autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    await p.send(0)
    await p.until(1)
    replies = []

    def later(msg):
        return LATER

    p.decide = later
    p.lane_b._routes[Forward] = lambda peer, msg, reply: replies.append((peer, msg, reply)) or LATER
    await p.send(1)
    with trio.fail_after(5):
        while not replies:  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert p.tokens == [0] and p.lane_a.status()["lanes"]["b"]["unacked"] == 1
    peer, msg, reply = replies[0]
    reply.done(Send(peer, Token(msg.request_id, msg.step, 7)))
    await p.until(2)
    await trio.sleep(0.5)
    assert p.lane_a.status()["lanes"]["b"]["unacked"] == 0


async def test_frames_on_a_broken_lane_go_by_the_transport_and_each_step_runs_once(nursery, autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    await p.send(0)
    await p.until(1)
    p.net.hub.set_delay("a", "b", 0.05)  # frames in flight long enough for a reset to catch them
    for step in range(1, 4):
        await p.send(step)
    p.net.hub.reset("a", "b")  # every stream between them breaks, the lanes too
    await p.until(4)
    for step in range(4, 8):
        await p.send(step)
    await p.until(8)
    ran = p.hot + p.loop
    assert sorted(ran) == list(range(8)) and len(ran) == len(set(ran))  # each step once, whoever carried it
    assert sorted(set(p.tokens)) == list(range(8))
    assert p.lane_a.stats.lost >= 1 and p.lane_a.stats.fell_back >= 1


async def test_a_step_that_came_by_both_paths_runs_once_and_the_repeat_gets_the_cached_answer(nursery,
                                                                                              autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    await p.send(0)
    await p.until(1)
    assert p.lane_a.send("b", fwd(1))
    await p.until(2)
    await p.a.post("b", fwd(1))  # the same step again, by the transport (a lost ack, say)
    await trio.sleep(1)
    assert p.hot == [1] and p.loop == [0] and p.tokens == [0, 1]
    assert p.b.stats.duplicates == 1 and p.b.stats.replays == 1  # its answer sent again (a drops the repeat)


class FollowingShortcut:
    """b's shortcut as a stage has one: once a step ran on the reader, the next step's frame is taken from its
    bytes (`swarmd.wire.follow`), and runs as the hot handler runs it."""

    def __init__(self, p: Pair) -> None:
        self.p = p
        self.follower: Follower | None = None
        self.decline: set[int] = set()
        self.taken: list[int] = []

    def follows(self, peer, body):
        seq = self.follower.seq(body) if self.follower is not None else None
        if seq is None:
            return None
        e = self.follower.expected
        return Known(("forward", e.request_id, e.step, e.hop), seq, "forward", self.follower)

    def take(self, known, body, arrived):
        step = known.expected.expected.step
        if step in self.decline:
            return DECLINE
        self.taken.append(step)
        self.p.hot.append(step)
        return Send("a", Token("req", step, 100 + step))

    def ran(self, peer, what):
        if isinstance(what, Known):
            self.follower = what.expected.then()
        else:
            self.follower = Follower(NextForward.of(what).then())


async def following_pair(nursery) -> tuple[Pair, FollowingShortcut]:
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    short = p.lane_b.shortcut = FollowingShortcut(p)
    await p.send(0)  # by the transport: the lane opens meanwhile
    await p.until(1)
    return p, short


async def test_the_step_after_one_run_on_the_reader_is_taken_from_its_bytes_and_answered_on_the_lane(nursery,
                                                                                                     autojump_clock):
    p, short = await following_pair(nursery)
    for step in range(1, 6):
        await p.send(step)
        await p.until(step + 1)
    assert p.hot == [1, 2, 3, 4, 5] and short.taken == [2, 3, 4, 5] and p.tokens == [0, 1, 2, 3, 4, 5]
    assert p.lane_b.stats.shortcut == 4 and p.lane_b.stats.hot == 5
    await trio.sleep(1)
    assert p.lane_a.stats.acked == 5  # each frame acked, whichever way it ran


async def test_a_repeat_of_a_step_taken_from_its_bytes_runs_once_and_gets_the_cached_answer(nursery, autojump_clock):
    p, short = await following_pair(nursery)
    for step in (1, 2, 3):
        await p.send(step)
        await p.until(step + 1)
    await p.a.post("b", fwd(3))  # step 3 again, by the transport (a lost ack, say)
    await trio.sleep(1)
    assert short.taken == [2, 3] and p.loop == [0] and p.hot == [1, 2, 3]
    assert p.b.stats.duplicates == 1 and p.b.stats.replays == 1


async def test_the_expected_step_that_came_first_by_the_transport_is_not_run_again_from_its_bytes(nursery,
                                                                                                  autojump_clock):
    p, short = await following_pair(nursery)
    for step in (1, 2):
        await p.send(step)
        await p.until(step + 1)
    await p.a.post("b", fwd(3))  # the transport brings step 3 first (the lane to b was full, say)
    await p.until(4)
    assert p.lane_a.send("b", fwd(3))  # ... and then the lane: it matches the frame expected, and is a repeat
    await trio.sleep(1)
    assert p.loop == [0, 3] and short.taken == [2] and p.tokens.count(3) == 1
    assert p.lane_b.stats.shortcut == 1


async def test_a_step_the_shortcut_declines_runs_on_the_event_loop_once(nursery, autojump_clock):
    p, short = await following_pair(nursery)
    short.decline = {3}
    for step in (1, 2, 3):
        await p.send(step)
        await p.until(step + 1)
    await trio.sleep(1)
    assert p.loop == [0, 3] and short.taken == [2] and p.tokens == [0, 1, 2, 3]
    assert p.lane_a.status()["lanes"]["b"]["unacked"] == 0


class AheadShortcut(FollowingShortcut):
    """A shortcut whose step's answer (a's Token) is framed and written before its message is built (`Ahead`):
    `then()` notes how many frames b's lane had written by then, and runs `meanwhile(step)` first."""

    def __init__(self, p: Pair) -> None:
        super().__init__(p)
        self.written_by_then: list[tuple[int, int]] = []  # (frames b had written when the step took, by then())
        self.meanwhile = lambda step: None
        self.unframed: set[int] = set()  # steps whose frame cannot be made (a bug of ours)

    def take(self, known, body, arrived):
        step = known.expected.expected.step
        self.taken.append(step)
        self.p.hot.append(step)
        token = Token("req", step, 100 + step)
        layout = Follower(NextToken.of(token))
        before = self.p.lane_b.stats.sent

        def then() -> Taken:
            self.written_by_then.append((before, self.p.lane_b.stats.sent))
            self.meanwhile(step)
            return Taken((Send("a", token),), (None,), ahead=True)

        def frame(seq: int) -> bytes:
            if step in self.unframed:
                raise RuntimeError("no frame")
            return layout.frame(seq, token)

        return Ahead("a", frame, then)


async def test_an_output_written_ahead_goes_before_its_message_is_built_and_is_acked_as_any_frame(nursery,
                                                                                                  autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    short = p.lane_b.shortcut = AheadShortcut(p)
    for step in range(6):
        await p.send(step)
        await p.until(step + 1)
    assert short.taken == [2, 3, 4, 5] and p.tokens == [0, 1, 2, 3, 4, 5]
    assert all(by_then == before + 1 for before, by_then in short.written_by_then)  # written, then built
    assert p.lane_b.stats.ahead == 4
    await trio.sleep(1)
    assert p.lane_b.status()["lanes"]["a"]["unacked"] == 0


async def test_an_output_written_ahead_on_a_lane_broken_before_its_message_is_built_goes_by_the_transport(
        nursery, autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    short = p.lane_b.shortcut = AheadShortcut(p)

    def break_lane(step: int) -> None:
        if step == 3:  # its frame is written, its message not yet known to the lane
            link = p.lane_b._out["a"]
            p.lane_b._lost(link, link.wire, "the stream broke")

    short.meanwhile = break_lane
    for step in range(5):
        await p.send(step)
        await p.until(step + 1)
    await trio.sleep(1)
    assert 3 in short.taken and p.tokens == [0, 1, 2, 3, 4]  # step 3's token by the transport, once
    assert p.lane_b.stats.lost == 1


async def test_a_frame_that_cannot_be_made_ahead_leaves_its_step_to_send_its_messages_as_any_other(nursery,
                                                                                                    autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    short = p.lane_b.shortcut = AheadShortcut(p)
    short.unframed = {3}
    for step in range(5):
        await p.send(step)
        await p.until(step + 1)
    assert short.taken == [2, 3, 4] and p.tokens == [0, 1, 2, 3, 4] and p.lane_b.stats.ahead == 2


async def test_a_path_that_cannot_detach_keeps_every_message_on_the_transport(nursery, autojump_clock):
    net = MemoryNet(nursery)
    net.wrap = lambda src, dst, stream: _Undetachable(stream)
    p = Pair(net)
    await p.start(nursery)
    for step in range(4):
        await p.send(step)
        await p.until(step + 1)
    await trio.sleep(1)
    assert p.loop == [0, 1, 2, 3] and p.hot == []
    assert "no data plane" in p.lane_a.status()["lanes"]["b"]["last_error"]


async def test_a_bad_lane_frame_is_answered_with_an_error_and_the_lane_goes_on(nursery, autojump_clock):
    p = Pair(MemoryNet(nursery))
    await p.start(nursery)
    stream = await p.net.endpoints["a"].open_stream("b", LANE_PROTOCOL, bulk=True)
    await stream.write(encode(Hello(1 << 20)))
    await _frame(stream)  # b's hello
    wide = Forward("req", 1, 1, 1, "head", hidden=WireTensor.from_array(np.zeros((1, HIDDEN + 1), np.float32)))
    await stream.write(encode_frame(wide, 5))  # the wrong width for b's model
    answer = decode(await _frame(stream))
    assert answer.seq == 5 and isinstance(answer.msg, Error) and answer.msg.code == "bad_shape"
    await stream.write(encode_frame(fwd(1), 6))
    assert decode_body(await _frame(stream)).seq == 6  # acked: the lane is still open
    assert p.hot == [1] and p.lane_b.stats.bad_frames == 1


async def _frame(stream) -> bytes:
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + HEADER.unpack(buf[:4])[0]:
        buf += await stream.read(1 << 16)
    return buf[4:]


class _Undetachable:
    """A stream whose path cannot be taken off the event loop (as a libp2p stream)."""

    def __init__(self, stream) -> None:
        self._s = stream

    async def read(self, n):
        return await self._s.read(n)

    async def write(self, data):
        await self._s.write(data)

    async def close(self):
        await self._s.close()

    async def reset(self):
        await self._s.reset()


def test_memory_streams_detach_and_wrapped_ones_do_not():
    assert not detachable(_Undetachable(None))
