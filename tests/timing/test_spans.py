"""Spans of traced requests: the recorder's bounds, spans between daemons, clock alignment of nodes with
injected skews, the Chrome trace and its per-token breakdown."""

from __future__ import annotations

import pytest

from swarmd.observe.spans import (
    NodeSpans,
    SpanRecorder,
    align,
    chrome_trace,
    decode_spans,
    encode_spans,
    flow_id,
)
from swarmd.observe.trace_summary import breakdown, per_token_parts

HEAD, S0, S1 = "12D3KooWhead", "12D3KooWzero", "12D3KooWone"


def test_only_traced_requests_are_recorded_and_only_the_latest_are_kept():
    rec = SpanRecorder(keep=2, max_spans=3)
    rec.add("r1", "stage.forward", "stage 0", 1.0, 2.0)
    assert rec.spans("r1") == []
    for rid in ("r1", "r2", "r3"):
        rec.trace(rid)
    for i in range(5):
        rec.add("r3", "stage.forward", "stage 0", i, i + 1, step=i)
    assert not rec.wants("r1") and rec.wants("r2")
    assert [s[4]["step"] for s in rec.spans("r3")] == [0, 1, 2]


def test_spans_cross_the_wire_and_malformed_entries_are_dropped():
    spans = [("stage.forward", "stage 1", 1.5, 2.25, {"step": 3, "batch": 2}), ("token", "head", 3.0, 3.0, {})]
    assert decode_spans(encode_spans(spans)) == spans
    import cbor2

    bad = cbor2.dumps([["x", "t", "not a time", 1.0, {}], ["ok", "t", 1, 2, {"k": [1]}], 5])
    assert decode_spans(bad) == [("ok", "t", 1.0, 2.0, {})]
    assert decode_spans(b"\xff\x00") == []


def hop(frm: str, to: str, key, t_ready: float, there: float, held: float, back: float, skews: dict[str, float]):
    """The sender's hop.send and the receiver's hop.deserialise of one frame, each on its own (skewed) clock."""
    flow = flow_id(key)
    t1 = t_ready + there
    send = (frm, ("hop.send", f"send -> {to[-6:]}", t_ready + skews[frm], t1 + held + back + skews[frm],
                  {"flow": flow, "to": to, "acked": True, "step": key[2], "msg": key[0], "bytes": 2400}))
    recv = (to, ("hop.deserialise", f"recv <- {frm[-6:]}", t1 + skews[to], t1 + held + skews[to],
                 {"flow": flow, "sender": frm, "step": key[2], "msg": key[0], "bytes": 2400}))
    return [send, recv]


def chain_spans(skews: dict[str, float], steps: int = 6) -> list[NodeSpans]:
    """A head sending to stage 0, stage 0 -> stage 1, stage 1 -> stage 0 (token) and -> head, with uneven
    transit times; each node's spans on its own clock."""
    per: dict[str, list] = {HEAD: [], S0: [], S1: []}
    t = 100.0
    for step in range(steps):
        slow = 0.004 if step % 2 else 0.0  # queueing on the way there, some of the time
        pairs = []
        if step == 0:
            pairs += hop(HEAD, S0, ("forward", "r", 0, 0), t, 0.0003 + slow, 0.0001, 0.0002, skews)
        pairs += hop(S0, S1, ("forward", "r", step, 1), t + 0.01, 0.0004 + slow, 0.0001, 0.0003, skews)
        pairs += hop(S1, S0, ("token", "r", step, 0), t + 0.02, 0.0003, 0.0001, 0.0003 + slow, skews)
        pairs += hop(S1, HEAD, ("token", "r", step, 1), t + 0.02, 0.0005 + slow, 0.0001, 0.0002, skews)
        for node, span in pairs:
            per[node].append(span)
        t += 0.05
    return [NodeSpans(HEAD, "head", per[HEAD]), NodeSpans(S0, "stage 0", per[S0], None),
            NodeSpans(S1, "stage 1", per[S1], None)]


@pytest.mark.parametrize("skews", [{HEAD: 0.0, S0: 0.0, S1: 0.0}, {HEAD: 0.0, S0: 12.5, S1: -3600.0},
                                   {HEAD: 50.0, S0: -7.25, S1: 0.003}])
def test_the_request_s_own_frames_align_nodes_with_injected_clock_skews(skews):
    aligned = {n.peer_id: n for n in align(chain_spans(skews), HEAD)}
    for peer in (S0, S1):
        n = aligned[peer]
        assert abs(n.offset - (skews[peer] - skews[HEAD])) <= n.offset_error + 1e-9
        assert n.offset_error < 0.0005  # the quick exchanges win over the queued ones


def test_a_probe_sample_aligns_a_node_the_request_s_frames_do_not_reach():
    nodes = [NodeSpans(HEAD, "head", []), NodeSpans(S0, "stage 0", [], offset=2.0, offset_error=0.001),
             NodeSpans(S1, "stage 1", [], offset=None)]
    aligned = {n.peer_id: n for n in align(nodes, HEAD)}
    assert aligned[S0].offset == pytest.approx(2.0) and aligned[S0].offset_error == pytest.approx(0.001)
    assert aligned[S1].offset is None


def test_the_chrome_trace_has_a_named_pid_per_node_flow_arrows_and_one_time_axis():
    skews = {HEAD: 0.0, S0: 12.5, S1: -3600.0}
    events = chrome_trace(align(chain_spans(skews), HEAD), request_id="r")
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: f"head {HEAD}", 2: f"stage 0 {S0}", 3: f"stage 1 {S1}"}
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert set(starts) == set(ends) and len(starts) == 1 + 3 * 6
    for fid, s in starts.items():
        assert ends[fid]["bp"] == "e" and ends[fid]["pid"] != s["pid"]
        assert ends[fid]["ts"] - s["ts"] >= 0  # on one axis the frame lands after it left
        assert ends[fid]["ts"] - s["ts"] < 6000  # microseconds: the transit, not the skew


def test_the_breakdown_gives_each_hop_its_median_over_decode_steps_and_the_wire_time():
    events = chrome_trace(align(chain_spans({HEAD: 0.0, S0: 5.0, S1: 9.0}), HEAD), request_id="r")
    b = breakdown(events)
    rows = {(r.where, r.phase): r for r in b.rows}
    wire = rows[("stage 0 -> stage 1 (forward)", "hop.wire")]
    # within the two stages' alignment errors (0.25 + 0.35 ms: half the best round trips to the head)
    assert wire.steps == 5 and wire.prefill_ms == pytest.approx(0.4, abs=0.6)
    assert wire.median_ms == pytest.approx(4.4, abs=0.6)  # steps 1, 3 and 5 of 1..5 queued 4 ms on the way
    assert rows[("stage 1 -> head (token)", "hop.deserialise")].median_ms == pytest.approx(0.1)
    assert per_token_parts(b)["hop.deserialise"] == pytest.approx(0.3)  # three hops a decode step, 0.1 ms each


def test_the_hop_timer_starts_a_trace_from_the_forward_that_asks_and_counts_every_frame():
    import numpy as np

    from swarmd.observe.hop_timer import HopTimer
    from swarmd.wire.codec import WireTensor
    from swarmd.wire.messages import Forward, Sampling, TraceQuery

    ticks = iter(range(1000))
    rec = SpanRecorder(clock=lambda: float(next(ticks)))
    counted: list[tuple] = []

    class Counters:
        def frame_sent(self, tag, nbytes, seconds, acked):
            counted.append(("sent", tag, nbytes, seconds, acked))

        def frame_received(self, tag, nbytes):
            counted.append(("received", tag, nbytes))

    timer = HopTimer(rec, Counters())
    tokens = WireTensor.from_array(np.array([1, 2], np.int32))
    plain = Forward("r-plain", 0, 0, 0, "head", tokens=tokens, sampling=Sampling())
    traced = Forward("r-traced", 0, 0, 0, "head", tokens=tokens, sampling=Sampling(trace=True))
    for msg in (plain, traced):
        timer.decoded("peer-a", msg, timer.now(), 100)
        timer.handling(msg)
    assert not rec.wants("r-plain") and rec.wants("r-traced")
    assert [s[0] for s in rec.spans("r-traced")] == ["hop.deserialise", "hop.admit"]
    timer.encoded("peer-b", 7, traced, timer.now(), 120)
    assert rec.inflight["r-traced"] == 1
    timer.settled("peer-b", 7, True)
    assert not rec.inflight and [s[0] for s in rec.spans("r-traced")][2:] == ["hop.serialise", "hop.send"]
    send = rec.spans("r-traced")[3]
    assert send[4]["flow"] == flow_id(traced.key()) == rec.spans("r-traced")[0][4]["flow"]
    timer.encoded("peer-b", 8, TraceQuery("r-traced"), timer.now(), 50)  # collecting is not part of the request
    timer.settled("peer-b", 8, True)
    assert len(rec.spans("r-traced")) == 4
    assert [c[:3] for c in counted] == [("received", "forward", 100), ("received", "forward", 100),
                                        ("sent", "forward", 120), ("sent", "trace_query", 50)]


EXP = "12D3KooWexperts"


def moe_spans(skews: dict[str, float], steps: int = 6) -> list[NodeSpans]:
    """`chain_spans` plus stage 0's router of block 1 sending one expert batch per step to an expert node off
    the chain (3 ms in its compute), each node on its own clock."""
    nodes = {n.peer_id: n for n in chain_spans(skews, steps)}
    s0, exp = list(nodes[S0].spans), []
    t = 100.0 + 0.005
    for step in range(steps):
        flow = flow_id(("expert_batch", f"moe-x-{step}", step, 1))
        there, back, slow = 0.0003, 0.0002, (0.002 if step % 2 else 0.0)
        t1, t2 = t + there + slow, t + there + slow + 0.0035
        common = {"step": step, "block": 1, "experts": "2,5", "rows": 1}
        s0 += [("moe.fan_out", "moe router 1", t + skews[S0], t2 + back + skews[S0], {**common, "messages": 1}),
               ("moe.send", "moe router 1", t + skews[S0], t + 0.0006 + skews[S0], {**common, "to": EXP}),
               ("moe.call", "moe router 1", t + skews[S0], t2 + back + skews[S0],
                {**common, "to": EXP, "answered": True, "flow": flow})]
        exp += [("expert.batch", "experts", t1 + skews[EXP], t2 + skews[EXP], {**common, "flow": flow}),
                ("expert.queue", "experts", t1 + skews[EXP], t1 + 0.0005 + skews[EXP], common),
                ("expert.forward", "experts", t1 + 0.0005 + skews[EXP], t2 + skews[EXP], common)]
        t += 0.05
    return [nodes[HEAD], NodeSpans(S0, "stage 0", s0, None), nodes[S1],
            NodeSpans(EXP, f"experts {EXP[-6:]}", exp, None)]


def test_an_expert_node_off_the_chain_is_found_and_aligned_through_its_expert_batches():
    from swarmd.observe.spans import expert_peers

    skews = {HEAD: 0.0, S0: 12.5, S1: -3600.0, EXP: 42.0}
    nodes = moe_spans(skews)
    assert expert_peers(n.spans for n in nodes) == {EXP}
    aligned = {n.peer_id: n for n in align(nodes, HEAD)}
    exp = aligned[EXP]
    assert abs(exp.offset - skews[EXP]) <= exp.offset_error + 1e-9
    assert exp.offset_error < 0.001  # stage 0's error plus half the quick batches' round trip
    events = chrome_trace(list(aligned.values()), request_id="r")
    to_expert = [e for e in events if e["ph"] == "f" and e["pid"] == 4]
    assert len(to_expert) == 6  # an arrow from each moe.call to the expert's batch


def test_the_breakdown_lists_each_block_s_fan_out_and_each_expert_node_apart_from_the_step_s_parts():
    skews = {HEAD: 0.0, S0: 5.0, S1: 9.0, EXP: -2.0}
    with_moe = breakdown(chrome_trace(align(moe_spans(skews), HEAD), request_id="r"))
    without = breakdown(chrome_trace(align(chain_spans(skews), HEAD), request_id="r"))
    rows = {(r.where, r.phase): r for r in with_moe.rows}
    exp = f"experts {EXP[-6:]}"
    assert rows[("stage 0, block 1", "moe.fan_out")].median_ms == pytest.approx(6.0)  # 3 of the 5 steps slow
    assert rows[(f"stage 0, block 1 -> {exp}", "moe.send")].median_ms == pytest.approx(0.6)
    assert rows[(f"stage 0, block 1 -> {exp}", "moe.call")].steps == 5
    assert rows[(f"{exp}, block 1", "expert.forward")].median_ms == pytest.approx(3.0)
    assert rows[(f"{exp}, block 1", "expert.queue")].prefill_ms == pytest.approx(0.5)
    assert with_moe.parts_ms == pytest.approx(without.parts_ms)  # inside stage.forward: not counted twice
    order = [r.where for r in with_moe.rows]
    assert order.index("stage 0, block 1") < order.index(f"{exp}, block 1")


async def test_the_head_waits_for_the_ack_of_its_own_last_frame_before_it_merges_its_spans(autojump_clock):
    import numpy as np
    import trio

    from swarmd.observe.hop_timer import HopTimer
    from swarmd.observe.trace_collect import SETTLE_TIMEOUT, TraceCollector
    from swarmd.wire.codec import WireTensor
    from swarmd.wire.messages import Forward, Sampling

    rec = SpanRecorder(clock=trio.current_time)
    rec.trace("r-traced")
    timer = HopTimer(rec)
    last = Forward("r-traced", 7, 0, 1, HEAD, tokens=WireTensor.from_array(np.array([3], np.int32)),
                   sampling=Sampling(trace=True))
    timer.encoded(S1, 41, last, timer.now(), 64)  # sent to the next stage; its ack comes with the lane's next batch
    collector = TraceCollector(HEAD, transport=None, recorder=rec)  # a chain of one: nothing to ask over the wire

    async def ack_later() -> None:
        await trio.sleep(SETTLE_TIMEOUT / 4)
        timer.settled(S1, 41, True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ack_later)
        events = await collector.collect("r-traced", [HEAD])
    assert [e["ph"] for e in events if e["name"] == "hop"] == ["s"]
    (send,) = [e for e in events if e["name"] == "hop.send"]
    assert send["args"]["acked"] and send["dur"] == pytest.approx(SETTLE_TIMEOUT / 4 * 1e6)
