"""The head gathers a traced request's spans from every node on its path and lays them on one time axis.

    stage i  <--TraceQuery(request_id, hop i)--  head
    stage i  --TraceSpans(spans, received, answered)-->  head

Each stage answers from its `SpanRecorder` once its own frames of the request are acked (so that their
`hop.send` spans are complete); the head waits for its own the same way. A MoE stage's spans name the nodes
its routers sent expert batches to (`moe.call`'s `to`); those off the chain are asked next, the same way, and
appear as `experts abc123` nodes (the end of the peer id). The head shifts each node's readings by that node's
clock offset: the best (least-delay) NTP-style sample from the swarm's probes, this very exchange, or the
request's own frames and their acks (`swarmd.observe.spans.align`).
The merged Chrome trace is kept in a `TraceStore` (the latest 20, bounded in size) for `GET /api/v0/traces`,
`GET /api/v0/traces/{request_id}` and `GET /api/v0/trace/{request_id}`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import trio

from swarmd.observe.clock import ClockOffsets
from swarmd.observe.spans import (
    NodeSpans,
    SpanRecorder,
    align,
    chrome_trace,
    decode_spans,
    encode_spans,
    expert_peers,
    role_of,
)
from swarmd.observe.trace_store import TraceStore
from swarmd.transport.transport import ActorTransport, DeliveryFailed, Refused, Send
from swarmd.wire.messages import TraceQuery, TraceSpans

log = logging.getLogger(__name__)

ANSWER_TIMEOUT = 5.0  # s the head waits for a stage's spans (a trace is best effort)
SETTLE_TIMEOUT = 2.0  # s a daemon waits for the acks of its last frames of a request (their hop.send spans)


class TraceCollector:
    def __init__(self, peer_id: str, transport: ActorTransport, recorder: SpanRecorder,
                 clocks: ClockOffsets | None = None, *, traces: TraceStore | None = None) -> None:
        self.peer_id = peer_id
        self.transport = transport
        self.recorder = recorder
        self.clocks = clocks if clocks is not None else ClockOffsets()
        self.traces = traces if traces is not None else TraceStore()
        self._waiting: dict[tuple[str, int], tuple[float, trio.Event, list[TraceSpans]]] = {}
        self._settled: dict[str, trio.Event] = {}
        self._token: trio.lowlevel.TrioToken | None = None  # the event loop's, for acks heard on a lane's thread
        recorder.on_settled = self._on_settled

    # --- a stage answers ------------------------------------------------------------------------------------

    async def on_query(self, peer: str, msg: TraceQuery) -> Send:
        received = self.recorder.clock()
        await self._settle(msg.request_id)
        spans = encode_spans(self.recorder.spans(msg.request_id))
        return Send(peer, TraceSpans(msg.request_id, spans, received=received, answered=self.recorder.clock(),
                                     hop=msg.hop))

    async def _settle(self, request_id: str) -> None:
        """Wait (at most SETTLE_TIMEOUT) until this daemon's frames of the request are acked."""
        if self.recorder.inflight.get(request_id):
            self._token = trio.lowlevel.current_trio_token()
            settled = self._settled.setdefault(request_id, trio.Event())
            with trio.move_on_after(SETTLE_TIMEOUT):
                await settled.wait()
            self._settled.pop(request_id, None)

    def _on_settled(self, request_id: str) -> None:
        """From any thread (the hot lane hears acks on its readers'): wake the query waiting for the request."""
        settled = self._settled.get(request_id)
        if settled is not None and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(settled.set)

    async def on_spans(self, peer: str, msg: TraceSpans) -> None:
        waiting = self._waiting.get((msg.request_id, msg.hop))
        if waiting is None:
            return
        asked, done, box = waiting
        self.clocks.add(peer, asked, msg.received, msg.answered, self.recorder.clock())
        box.append(msg)
        done.set()

    # --- the head merges --------------------------------------------------------------------------------------

    async def collect(self, request_id: str, stages: Sequence[str]) -> list[dict[str, Any]]:
        """The request's Chrome trace events from this daemon and every stage (by hop) of its chain."""
        remote: dict[str, list[Any]] = {}

        async def ask(hop: int, peer: str) -> None:
            done, box = trio.Event(), []
            self._waiting[(request_id, hop)] = (self.recorder.clock(), done, box)
            try:
                with trio.move_on_after(ANSWER_TIMEOUT):
                    await self.transport.send(peer, TraceQuery(request_id, hop=hop), within=ANSWER_TIMEOUT)
                    await done.wait()
            except (Refused, DeliveryFailed) as e:
                log.info("no spans of %s from stage %d: %s", request_id, hop, e)
            finally:
                self._waiting.pop((request_id, hop), None)
            if box:
                remote[peer] = decode_spans(box[0].spans)

        firsts = {}
        for hop, peer in enumerate(stages):
            if peer != self.peer_id:
                firsts.setdefault(peer, hop)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._settle, request_id)  # the head's own last frames too
            for peer, hop in firsts.items():
                nursery.start_soon(ask, hop, peer)
        mine = self.recorder.spans(request_id)
        experts = expert_peers([mine, *remote.values()]) - set(firsts) - {self.peer_id}
        async with trio.open_nursery() as nursery:  # off the chain: numbered after its stages
            for i, peer in enumerate(sorted(experts)):
                nursery.start_soon(ask, len(stages) + i, peer)
        nodes = [NodeSpans(self.peer_id, role_of(self.peer_id, self.peer_id, stages), mine, 0.0, 0.0)]
        for peer in [*firsts, *sorted(experts)]:
            best = self.clocks.best(peer)
            role = f"experts {peer[-6:]}" if peer in experts else role_of(peer, self.peer_id, stages)
            nodes.append(NodeSpans(peer, role, remote.get(peer, []), best.offset if best else None,
                                   best.error if best else None))
        events = chrome_trace(align(nodes, self.peer_id), request_id=request_id)
        self.traces.put(request_id, events)
        return events
