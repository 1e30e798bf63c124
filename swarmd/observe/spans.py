"""Spans of traced requests as one daemon sees them, on its own clock; turned into one Chrome trace by the head.

A request is traced when its client asks (`"trace": true`): the head marks it here, and every stage marks it
when its first `Forward` arrives (the flag travels in `Sampling.trace`). Only marked requests are recorded, so
an untraced request costs a set lookup where a span would be. Spans are kept per request (the most recent
`keep` requests, at most `max_spans` each) until the head collects them with a `TraceQuery`.

    recorder.add(request_id, "stage.forward", "stage 1", start, end, step=4, batch=2)   # seconds

A span is `(name, thread, start, end, args)`. Spans of one message's hop share `args["flow"]` (the sender's
`hop.send` and the receiver's `hop.deserialise`), which becomes a flow arrow in the trace.
`align` puts every node of a request on the head's clock: each frame of the request and its ack is an
NTP-style exchange between two nodes (`hop_samples`), and so is each swarm probe between the head and a node
(`swarmd.observe.clock`); the least-delay sample of each pair wins, and offsets add up along the least-error path
from the head. `chrome_trace` then takes each node's offset off its readings.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import cbor2

from swarmd.observe.chrome_trace import Tracer
from swarmd.observe.clock import ClockSample

Span = tuple[str, str, float, float, dict[str, Any]]  # name, thread, start s, end s, args
KEEP_REQUESTS = 64
MAX_SPANS = 50_000  # per request and node: about 1,000 steps


class SpanRecorder:
    """The traced requests' spans on this daemon (bounded: the latest `keep` requests)."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, keep: int = KEEP_REQUESTS,
                 max_spans: int = MAX_SPANS) -> None:
        self.clock = clock
        self._spans: OrderedDict[str, list[Span]] = OrderedDict()
        self._keep = keep
        self._max = max_spans
        self.inflight: Counter[str] = Counter()  # traced requests' frames sent and not yet acked
        self.on_settled: Callable[[str], None] | None = None  # told when a request has no frame in flight

    def trace(self, request_id: str) -> None:
        """Record the spans of `request_id` from now on."""
        if request_id not in self._spans:
            self._spans[request_id] = []
            while len(self._spans) > self._keep:
                old, _ = self._spans.popitem(last=False)
                self.inflight.pop(old, None)

    def settle(self, request_id: str) -> None:
        """A frame of a traced request was acked (or given up)."""
        left = self.inflight[request_id] - 1
        if left > 0:
            self.inflight[request_id] = left
        else:
            self.inflight.pop(request_id, None)
            if self.on_settled is not None:
                self.on_settled(request_id)

    def wants(self, request_id: str) -> bool:
        return request_id in self._spans

    def add(self, request_id: str, name: str, thread: str, start: float, end: float, **args: Any) -> None:
        spans = self._spans.get(request_id)
        if spans is not None and len(spans) < self._max:
            spans.append((name, thread, start, end, args))

    def spans(self, request_id: str) -> list[Span]:
        return list(self._spans.get(request_id, ()))


def flow_id(key: tuple[str, str, int, int]) -> int:
    """One id per message (its de-duplication key), the same on the sender and on the receiver."""
    return zlib.crc32("/".join(map(str, key)).encode())


def record_stage_step(recorder: SpanRecorder, job: Any, sent: float, hop: int) -> None:
    """A stage's part of one step (`swarmd.inference.stage.actor.Job`'s perf_counter readings): waiting in the queue (and for
    the rest of a batch), the hand-over to the compute thread, the model, sampling (last stage), building the
    output until the transport has it."""
    w, thread = job.work, f"stage {hop}"
    rid, args = w.request_id, {"step": w.step, "rows": w.rows, "batch": job.batch}
    computed = job.computed or job.ended
    recorder.add(rid, "stage.queue", thread, job.received, job.taken, **args)
    recorder.add(rid, "stage.handover", thread, job.taken, job.started, **args)
    recorder.add(rid, "stage.forward", thread, job.started, computed, **args)
    if w.sampling is not None:  # the last stage
        recorder.add(rid, "stage.sample", thread, computed, job.ended, **args)
    recorder.add(rid, "stage.output", thread, job.ended, sent, **args)


# --- between daemons: a stage's spans in a TraceSpans message ---------------------------------------------------


def encode_spans(spans: Iterable[Span]) -> bytes:
    return cbor2.dumps([[n, t, s, e, a] for n, t, s, e, a in spans])


def decode_spans(data: bytes) -> list[Span]:
    """Spans from a peer; malformed entries are dropped (a trace is best effort, never a reason to fail)."""
    try:
        raw = cbor2.loads(data)
    except Exception:
        return []
    out: list[Span] = []
    for item in raw if isinstance(raw, list) else ():
        if (isinstance(item, list) and len(item) == 5 and isinstance(item[0], str) and isinstance(item[1], str)
                and all(isinstance(x, int | float) for x in item[2:4]) and isinstance(item[4], dict)):
            out.append((item[0][:64], item[1][:64], float(item[2]), float(item[3]),
                        {str(k)[:64]: v for k, v in item[4].items() if isinstance(v, str | int | float | bool)}))
    return out


# --- the merged trace ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpans:
    """One daemon's spans of a request; `offset`: s its clock reads ahead of the head's (None: unknown)."""

    peer_id: str
    role: str  # "head", "stage 1", "head, stage 0", ...
    spans: list[Span]
    offset: float | None = 0.0
    offset_error: float | None = None


def expert_peers(span_lists: Iterable[Iterable[Span]]) -> set[str]:
    """The nodes MoE routers sent this request's expert batches to (`moe.call`'s `to`)."""
    return {str(args["to"]) for spans in span_lists for name, _, _, _, args in spans
            if name == "moe.call" and args.get("to")}


# (sender's span, its condition) and receiver's span of the exchanges that make clock samples
_EXCHANGES = {"hop.send": "acked", "moe.call": "answered"}
_RECEIVED = frozenset({"hop.deserialise", "expert.batch"})


def hop_samples(nodes: Iterable[NodeSpans]) -> dict[tuple[str, str], ClockSample]:
    """Per ordered pair of nodes (a, b), the least-delay clock sample of b against a from the request's own
    messages, each an NTP-style exchange: a frame and its ack (t0: a had the frame ready, hop.send's start;
    t1 and t2: b decoded it, hop.deserialise, and acks only after that; t3: a had the ack, hop.send's end),
    and a MoE router's expert batch and its answer (moe.call on a, expert.batch on b)."""
    sends: dict[int, tuple[str, str, float, float]] = {}
    recvs: dict[int, tuple[str, float, float]] = {}
    for node in nodes:
        for name, _, start, end, args in node.spans:
            flow = args.get("flow")
            if flow is None:
                continue
            if name in _EXCHANGES and args.get(_EXCHANGES[name]):
                sends[flow] = (node.peer_id, str(args.get("to", "")), start, end)
            elif name in _RECEIVED:
                recvs[flow] = (node.peer_id, start, end)
    best: dict[tuple[str, str], ClockSample] = {}
    for flow, (a, to, t0, t3) in sends.items():
        got = recvs.get(flow)
        if got is None or got[0] != to or not (t3 >= t0 and got[2] >= got[1]):
            continue
        sample = ClockSample.of(t0, got[1], got[2], t3)
        if (a, to) not in best or sample.delay < best[(a, to)].delay:
            best[(a, to)] = sample
    return best


def align(nodes: list[NodeSpans], head: str) -> list[NodeSpans]:
    """Each node's offset against the head: the best of the given (probe) sample and the chain of least-delay
    frame samples from the head to it (offsets add along the chain, and so do their errors)."""
    edges: dict[tuple[str, str], ClockSample] = {}
    for (a, b), s in hop_samples(nodes).items():
        edges[(a, b)] = s
        back = ClockSample(-s.offset, s.delay)
        if (b, a) not in edges or back.delay < edges[(b, a)].delay:
            edges[(b, a)] = back
    for n in nodes:  # the probes' samples, head -> node
        if n.peer_id != head and n.offset is not None and n.offset_error is not None:
            s = ClockSample(n.offset, 2 * n.offset_error)
            if (head, n.peer_id) not in edges or s.delay < edges[(head, n.peer_id)].delay:
                edges[(head, n.peer_id)] = s
    # Least total error from the head to every node (Dijkstra over the error bounds).
    found: dict[str, tuple[float, float]] = {}  # peer -> (offset, error)
    frontier = {head: (0.0, 0.0)}
    while frontier:
        peer = min(frontier, key=lambda p: frontier[p][1])
        found[peer] = frontier.pop(peer)
        for (a, b), s in edges.items():
            if a == peer and b not in found:
                cand = (found[peer][0] + s.offset, found[peer][1] + s.error)
                if b not in frontier or cand[1] < frontier[b][1]:
                    frontier[b] = cand
    out = []
    for n in nodes:
        offset, error = found.get(n.peer_id, (None, None))
        out.append(NodeSpans(n.peer_id, n.role, n.spans, offset, error))
    return out


def chrome_trace(nodes: Iterable[NodeSpans], *, request_id: str) -> list[dict[str, Any]]:
    """Chrome trace events of a request: one pid per node (named by its peer id), one tid per actor, flow
    arrows from each `hop.send` to the `hop.deserialise` of the same message; timestamps on the head's clock."""
    events: list[dict[str, Any]] = []
    for pid, node in enumerate(nodes, start=1):
        tracer = Tracer(f"{node.role} {node.peer_id}", pid=pid)
        tracer.events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                              "args": {"sort_index": pid}})
        tracer.events.append({"name": "process_labels", "ph": "M", "pid": pid, "tid": 0,
                              "args": {"labels": _clock_label(node)}})
        shift = node.offset or 0.0
        for name, thread, start, end, args in node.spans:
            s, e = (start - shift) * 1e6, (end - shift) * 1e6
            if args.get("instant"):
                tracer.events.append({"name": name, "ph": "i", "s": "t", "ts": round(s, 1), "pid": pid,
                                      "tid": tracer.thread_id(thread), "args": {**args, "request_id": request_id}})
                continue
            tracer.complete(name, s, e, thread=thread, **args)
            flow = args.get("flow")
            if flow is not None and name in FLOW_ENDS:
                phase = FLOW_ENDS[name]
                ev = {"name": "hop", "cat": "hop", "ph": phase, "id": flow, "ts": round(s, 1), "pid": pid,
                      "tid": tracer.thread_id(thread)}
                if phase == "f":
                    ev["bp"] = "e"
                tracer.events.append(ev)
        events += tracer.events
    return events


FLOW_ENDS = {"hop.send": "s", "hop.deserialise": "f", "moe.call": "s", "expert.batch": "f"}


def _clock_label(node: NodeSpans) -> str:
    if node.offset is None:
        return "clock offset unknown (not corrected)"
    err = "" if node.offset_error is None else f" ± {node.offset_error * 1e3:.3f} ms"
    return f"clock offset {node.offset * 1e3:+.3f} ms{err} (corrected)"


def role_of(peer_id: str, head: str, stages: Mapping[int, str] | Iterable[str]) -> str:
    hops = [i for i, p in (stages.items() if isinstance(stages, Mapping) else enumerate(stages)) if p == peer_id]
    parts = (["head"] if peer_id == head else []) + [f"stage {i}" for i in hops]
    return ", ".join(parts) or "node"
