"""What each hop costs: the actor transport's `FrameObserver` for metrics (always) and spans (traced requests).

Per frame the transport reports when encoding began and how many bytes it made (`encoded`), when the frame
was acked or given up (`settled`), how long decoding and checking an inbound frame took (`decoded`) and when
its handler starts (`handling`), and the bytes of a frame taken without decoding (`received`). From those:

    hop.serialise    sender: CBOR encoding of the message (tensors included)
    hop.send         sender: frame ready -> ack back (write, wire both ways, receiver's decode and admission)
    hop.deserialise  receiver: strict decoding and the receiver's checks
    hop.admit        receiver: checked -> its handler starts (the ack is written in between)

Metrics see every frame: bytes each way by message type, and the send-to-ack latency. Spans are recorded
only for requests the `SpanRecorder` traces; a `Forward` whose sampling asks for a trace starts one.

The transport calls it on the event loop, the hot lane (`swarmd.transport.lane`) from its readers' threads: each
call holds one lock. The lane numbers its frames on its own and tells them with negative seqs.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from swarmd.observe.spans import SpanRecorder, flow_id
from swarmd.wire.messages import Key, Message, request_id_of

UNTRACED = frozenset({"trace_query", "trace_spans"})  # collecting a trace is not part of the request
MAX_OPEN = 100_000  # frames awaiting an ack that are remembered (more means acks are lost: start again)


class WireCounters(Protocol):
    def frame_sent(self, tag: str, nbytes: int, seconds_to_ack: float, acked: bool) -> None: ...

    def frame_received(self, tag: str, nbytes: int) -> None: ...


class HopTimer:
    def __init__(self, recorder: SpanRecorder | None = None, counters: WireCounters | None = None) -> None:
        self.recorder = recorder
        self.counters = counters
        self.now = recorder.clock if recorder is not None else time.perf_counter
        self._out: dict[tuple[str, int], tuple[Key | None, str, float, int, str]] = {}
        self._in: dict[Key, tuple[str, float]] = {}  # traced frames checked (sender, when), handler not started
        self._lock = threading.Lock()

    def encoded(self, peer: str, seq: int, msg: Message, started: float, nbytes: int) -> None:
        with self._lock:
            self._encoded(peer, seq, msg, started, nbytes)

    def settled(self, peer: str, seq: int, acked: bool) -> None:
        with self._lock:
            self._settled(peer, seq, acked)

    def decoded(self, peer: str, msg: Message, started: float, nbytes: int) -> None:
        with self._lock:
            self._decoded(peer, msg, started, nbytes)

    def handling(self, msg: Message) -> None:
        if self._in:
            with self._lock:
                self._handling(msg)

    def received(self, tag: str, nbytes: int) -> None:
        """A frame the lane took without decoding it (`swarmd.wire.follow`): an untraced request's, counted."""
        if self.counters is not None:
            self.counters.frame_received(tag, nbytes)

    def _encoded(self, peer: str, seq: int, msg: Message, started: float, nbytes: int) -> None:
        end = self.now()
        if len(self._out) >= MAX_OPEN:
            self._out.clear()
        rid = request_id_of(msg)
        key = msg.key()
        self._out[(peer, seq)] = (key, rid, end, nbytes, msg.TAG)
        rec = self.recorder
        if rid and rec is not None and rec.wants(rid) and msg.TAG not in UNTRACED:
            rec.inflight[rid] += 1
            rec.add(rid, "hop.serialise", f"send -> {peer[-6:]}", started, end, msg=msg.TAG,
                    step=key[2] if key else 0, hop=key[3] if key else 0, to=peer, bytes=nbytes)

    def _settled(self, peer: str, seq: int, acked: bool) -> None:
        entry = self._out.pop((peer, seq), None)
        if entry is None:
            return
        key, rid, ready, nbytes, tag = entry
        now = self.now()
        if self.counters is not None:
            self.counters.frame_sent(tag, nbytes, now - ready, acked)
        rec = self.recorder
        if rid and key and rec is not None and rec.wants(rid) and tag not in UNTRACED:
            rec.settle(rid)
            rec.add(rid, "hop.send", f"send -> {peer[-6:]}", ready, now, msg=tag, step=key[2], hop=key[3], to=peer,
                    bytes=nbytes, acked=acked, flow=flow_id(key))

    def _decoded(self, peer: str, msg: Message, started: float, nbytes: int) -> None:
        end = self.now()
        if self.counters is not None:
            self.counters.frame_received(msg.TAG, nbytes)
        rec = self.recorder
        rid = request_id_of(msg)
        if not rid or rec is None or msg.TAG in UNTRACED:
            return
        if not rec.wants(rid):
            sampling = getattr(msg, "sampling", None)
            if sampling is None or not sampling.trace:
                return
            rec.trace(rid)
        key = msg.key()
        if key is None:
            return
        thread = f"recv <- {peer[-6:]}"
        rec.add(rid, "hop.deserialise", thread, started, end, msg=msg.TAG, step=key[2], hop=key[3], bytes=nbytes,
                flow=flow_id(key), sender=peer)
        if len(self._in) >= MAX_OPEN:
            self._in.clear()
        self._in[key] = (peer, end)

    def _handling(self, msg: Message) -> None:
        key = msg.key()
        entry = self._in.pop(key, None) if key else None
        if entry is not None and self.recorder is not None and key is not None:
            peer, checked = entry
            self.recorder.add(request_id_of(msg), "hop.admit", f"recv <- {peer[-6:]}", checked, self.now(),
                              msg=msg.TAG, step=key[2], hop=key[3], sender=peer)

