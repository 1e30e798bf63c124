"""Prometheus metrics of one daemon, read from its state at scrape time (text exposition format).

Each node has its own registry, so several nodes in one process (tests) do not mix. Other parts
of the daemon register their own metrics on `NodeMetrics.registry` with prometheus_client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarmd.observe.gc_collections import COLLECTIONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SwarmCollector(Collector):
    """Turns the node's status snapshot and swarm counters into metric families."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], counters: Callable[[], dict[str, float]]) -> None:
        self.snapshot = snapshot
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        me = s["self"]["peer_id"]
        states = GaugeMetricFamily("swarmd_members", "Members by state, self included", labels=["state"])
        for state in ("alive", "suspect", "dead"):
            states.add_metric([state], sum(1 for m in s["members"] if m["state"] == state))
        yield states
        yield GaugeMetricFamily("swarmd_refused_peers", "Peers refused (other model or version)",
                                value=len(s["refused"]))
        yield GaugeMetricFamily("swarmd_term", "Election term", value=s["term"])
        yield GaugeMetricFamily("swarmd_is_leader", "1 if this node leads", value=int(s["leader"] == me))
        yield GaugeMetricFamily("swarmd_admitted", "1 once admitted to the swarm", value=int(s["admitted"]))
        plan = s["plan"]
        yield GaugeMetricFamily("swarmd_plan_epoch", "Epoch of the plan in force (0: none)",
                                value=plan["epoch"] if plan else 0)
        a = s["assignment"]
        yield GaugeMetricFamily("swarmd_stage_ready", "1 when the assigned stage is loaded",
                                value=int(a["state"] == "ready"))
        yield GaugeMetricFamily("swarmd_requests_in_flight", "Requests in flight", value=s["requests_in_flight"])
        rtt = GaugeMetricFamily("swarmd_peer_rtt_milliseconds", "Probe round trip to a member", labels=["peer"])
        for m in s["members"]:
            if m["rtt_ms"] is not None:
                rtt.add_metric([m["peer_id"]], m["rtt_ms"])
        yield rtt
        labelled: dict[str, CounterMetricFamily] = {}
        for name, value in sorted(self.counters().items()):
            if ":" in name:  # "plans_rejected:stale" -> swarmd_plans_rejected_total{reason="stale"}
                family, reason = name.split(":", 1)
                if family not in labelled:
                    labelled[family] = CounterMetricFamily(f"swarmd_{family}", f"{family.replace('_', ' ')} by reason",
                                                           labels=["reason"])
                labelled[family].add_metric([reason], value)
            else:
                yield CounterMetricFamily(f"swarmd_{name}", f"swarm counter {name.replace('_', ' ')}", value=value)
        yield from labelled.values()


class CollectionsCollector(Collector):
    """Python's cyclic collections on the compute thread (`swarmd.observe.gc_collections.COLLECTIONS`): each one holds the
    interpreter lock, so a step's output waits for it."""

    def collect(self) -> Iterator[Metric]:
        count = CounterMetricFamily("swarmd_gc_collections", "Cyclic collections between jobs on the compute thread",
                                    labels=["generation"])
        seconds = CounterMetricFamily("swarmd_gc_seconds", "Time spent in them", labels=["generation"])
        longest = GaugeMetricFamily("swarmd_gc_longest_seconds", "The longest one", labels=["generation"])
        for g in range(3):
            count.add_metric([str(g)], COLLECTIONS.count[g])
            seconds.add_metric([str(g)], COLLECTIONS.seconds[g])
            longest.add_metric([str(g)], COLLECTIONS.longest[g])
        yield from (count, seconds, longest)


class NodeMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], counters: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(SwarmCollector(snapshot, counters))
        self.registry.register(CollectionsCollector())

    def render(self) -> bytes:
        return generate_latest(self.registry)
