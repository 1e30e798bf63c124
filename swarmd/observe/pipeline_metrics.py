"""Prometheus metrics of the pipeline on `/metrics`: tokens, requests, time to first token, hops, KV memory.

Histograms are observed as things happen (time to first token by the head, send-to-ack latency per frame by
the transport's `HopTimer`); counters that the actors keep anyway (requests, tokens, steps, retries) are read
at scrape time.

    swarmd_time_to_first_token_seconds    histogram   request sent to stage 0 -> its first token back
    swarmd_hop_latency_seconds{msg}       histogram   actor frame ready -> acked
    swarmd_wire_bytes_total{direction,msg} counter    actor frame bytes sent (acked) and received
    swarmd_tokens_total, swarmd_requests_total{outcome}, swarmd_stage_steps_total, swarmd_stage_batches_total
    swarmd_transport_frames_total{event}              resent (retries), reconnects, expired, refused, duplicates
    swarmd_kv_cache_bytes, swarmd_kv_cache_slots{state}
    swarmd_queue_depth                    gauge       requests waiting in this daemon's queue for a KV slot
    swarmd_queue_wait_seconds             histogram   arrival (or a busy stage's refusal) -> its turn
    swarmd_queue_refused_total            counter     requests refused with 429 (queue full, or pushed out)
    swarmd_stage_slots{hop,peer,state}    gauge       KV slots of each stage of the chain (used, total), as seen here
    swarmd_stage_moved_requests_total{kv}             moved requests this stage continued: kv adopted or rebuilt
    swarmd_expert_tokens_total{block,expert}          tokens this daemon's MoE routers sent to each expert
    swarmd_moe_fanout_messages_total{block}           expert batches they sent (one per node hit per step)
    swarmd_spec_drafted_tokens_total, swarmd_spec_accepted_tokens_total, swarmd_spec_verify_passes_total,
    swarmd_spec_draft_seconds_total, swarmd_spec_accepted_length (histogram: drafted tokens accepted per pass)
                                                      speculative requests this daemon headed
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

HOP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
TRANSPORT_EVENTS = ("resent", "reconnects", "connect_failures", "expired", "refused", "duplicates", "replays",
                    "bad_frames")


class WireMetrics:
    """What `HopTimer` counts for every frame (its `WireCounters`)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.hop_latency = Histogram("swarmd_hop_latency_seconds", "Actor frame ready to acked, by message type",
                                     ["msg"], buckets=HOP_BUCKETS, registry=registry)
        self.wire_bytes = Counter("swarmd_wire_bytes", "Actor frame bytes by direction and message type",
                                  ["direction", "msg"], registry=registry)
        self._children: dict[tuple[str, str], Any] = {}  # labels() looks its child up under a lock: once

    def _child(self, kind: str, tag: str) -> Any:
        child = self._children.get((kind, tag))
        if child is None:
            child = self.hop_latency.labels(tag) if kind == "latency" else self.wire_bytes.labels(kind, tag)
            self._children[(kind, tag)] = child
        return child

    def frame_sent(self, tag: str, nbytes: int, seconds_to_ack: float, acked: bool) -> None:
        if acked:
            self._child("latency", tag).observe(seconds_to_ack)
            self._child("sent", tag).inc(nbytes)

    def frame_received(self, tag: str, nbytes: int) -> None:
        self._child("received", tag).inc(nbytes)


class PipelineCollector(Collector):
    """Counters the pipeline keeps anyway, read at scrape time (`pipeline` is a `swarmd.inference.pipeline.Pipeline`)."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def collect(self) -> Iterator[Metric]:
        p = self.pipeline
        head = p.head.stats
        yield CounterMetricFamily("swarmd_tokens", "Tokens generated for requests this daemon headed",
                                  value=head["tokens"])
        requests = CounterMetricFamily("swarmd_requests", "Requests this daemon headed, by outcome",
                                       labels=["outcome"])
        for outcome in ("finished", "failed", "cancelled"):
            requests.add_metric([outcome], head[outcome])
        yield requests
        stage = p.stage.stats
        yield CounterMetricFamily("swarmd_stage_steps", "Request steps this daemon's stage ran", value=stage.jobs)
        yield CounterMetricFamily("swarmd_stage_batches", "Model calls of this daemon's stage", value=stage.batches)
        moved = CounterMetricFamily("swarmd_stage_moved_requests", "Moved requests this daemon's stage continued: "
                                    "keeping their KV cache (adopted) or rebuilding it (rebuilt)", labels=["kv"])
        moved.add_metric(["adopted"], stage.kv_adopted)
        moved.add_metric(["rebuilt"], stage.kv_rebuilt)
        yield moved
        frames = CounterMetricFamily("swarmd_transport_frames", "Actor transport events (resent: retries)",
                                     labels=["event"])
        for event in TRANSPORT_EVENTS:
            frames.add_metric([event], getattr(p.transport.stats, event))
        yield frames
        kv_bytes = GaugeMetricFamily("swarmd_kv_cache_bytes", "Memory held for KV caches by the loaded stage")
        slots = GaugeMetricFamily("swarmd_kv_cache_slots", "KV cache slots of the loaded stage", labels=["state"])
        loaded = p.loaded()
        if loaded is not None and hasattr(loaded.model, "kv"):
            model = loaded.model
            kv_bytes.add_metric([], model.kv.nbytes())
            used = len(model.slots)
            slots.add_metric(["used"], used)
            slots.add_metric(["free"], model.max_requests - used)
        yield kv_bytes
        yield slots
        yield from _queue_metrics(p)
        yield from _moe_metrics(p)
        yield from _spec_metrics(p)


def _queue_metrics(pipeline: Any) -> Iterator[Metric]:
    """This daemon's queue, and the chain's KV slots as its head sees them."""
    queue = pipeline.head.admission.status()
    yield GaugeMetricFamily("swarmd_queue_depth", "Requests waiting in this daemon's queue for a KV slot",
                            value=queue["queued"])
    yield CounterMetricFamily("swarmd_queue_refused", "Requests refused with 429: the queue was full, or they "
                              "were pushed out of it", value=queue["refused"])
    slots = GaugeMetricFamily("swarmd_stage_slots", "KV slots of each stage of the chain, as this daemon sees them",
                              labels=["hop", "peer", "state"])
    for st in queue["stages"]:
        if st["slots"] is not None:
            slots.add_metric([str(st["hop"]), st["peer_id"], "total"], st["slots"])
            slots.add_metric([str(st["hop"]), st["peer_id"], "used"], st["used"] or 0)
    yield slots


def _moe_metrics(pipeline: Any) -> Iterator[Metric]:
    """Expert load: tokens routed per expert and fan-out messages, from this daemon's MoE routers."""
    router = getattr(pipeline, "router", None)
    layers = router.status()["layers"] if router is not None else {}
    tokens = CounterMetricFamily("swarmd_expert_tokens", "Tokens this daemon's MoE routers sent to each expert",
                                 labels=["block", "expert"])
    messages = CounterMetricFamily("swarmd_moe_fanout_messages", "Expert batches sent by this daemon's MoE routers",
                                   labels=["block"])
    for block, layer in layers.items():
        messages.add_metric([block], layer["messages"])
        for expert, n in layer["tokens"].items():
            tokens.add_metric([block, expert], n)
    yield tokens
    yield messages


def _spec_metrics(pipeline: Any) -> Iterator[Metric]:
    """Speculative decoding on this daemon's head: drafts, acceptance, passes through the chain."""
    stats = pipeline.head.speculation.stats
    yield CounterMetricFamily("swarmd_spec_drafted_tokens", "Tokens drafted and sent for verification",
                              value=stats.drafted)
    yield CounterMetricFamily("swarmd_spec_accepted_tokens", "Drafted tokens the chain accepted", value=stats.accepted)
    yield CounterMetricFamily("swarmd_spec_verify_passes", "Speculative steps through the chain", value=stats.passes)
    yield CounterMetricFamily("swarmd_spec_draft_seconds", "Time spent drafting", value=stats.draft_seconds)
    cumulative, buckets = 0, []
    for bound, n in zip(stats.bounds, stats.buckets, strict=True):
        cumulative += n
        buckets.append((str(float(bound)), cumulative))
    buckets.append(("+Inf", cumulative + stats.over))
    yield HistogramMetricFamily("swarmd_spec_accepted_length", "Drafted tokens accepted per pass", buckets=buckets,
                                sum_value=stats.accepted)


def register_pipeline_metrics(registry: CollectorRegistry, pipeline: Any) -> tuple[WireMetrics, Histogram]:
    """Register the pipeline's metrics; returns the frame counters (for the HopTimer) and the TTFT histogram."""
    registry.register(PipelineCollector(pipeline))
    ttft = Histogram("swarmd_time_to_first_token_seconds", "Request sent into the chain to its first token",
                     buckets=TTFT_BUCKETS, registry=registry)
    wait = Histogram("swarmd_queue_wait_seconds", "Time a request waited in this daemon's queue for its turn",
                     buckets=WAIT_BUCKETS, registry=registry)
    pipeline.head.admission.on_wait_time = wait.observe
    return WireMetrics(registry), ttft
