"""The weights fetch in /metrics: bytes fetched and to fetch, rate and time left, as gauges.

Counters (bytes and chunks served, fetched, refused, bad chunks, lost sources) come with the node's other
counters as `swarmd_weights_*`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import trio
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from swarmd.weights.service import WeightsService


class WeightsCollector(Collector):
    def __init__(self, weights: WeightsService) -> None:
        self.weights = weights

    def collect(self) -> Iterator[Metric]:
        w = self.weights
        p = w.progress
        now = trio.current_time()
        yield GaugeMetricFamily("swarmd_weights_held_bytes", "Bytes of the model's weights held on this machine",
                                value=w.store.held_bytes() if w.store is not None else 0)
        yield GaugeMetricFamily("swarmd_weights_fetching", "1 while weights are being fetched", value=int(p.active))
        yield GaugeMetricFamily("swarmd_weights_fetch_done_bytes", "Bytes of the current (or last) fetch received",
                                value=p.done)
        yield GaugeMetricFamily("swarmd_weights_fetch_total_bytes", "Bytes the current (or last) fetch wants",
                                value=p.total)
        yield GaugeMetricFamily("swarmd_weights_fetch_rate_bytes_per_second", "Fetch rate over the last seconds",
                                value=p.rate(now))
        eta = p.eta(now)
        yield GaugeMetricFamily("swarmd_weights_fetch_eta_seconds", "Time left of the fetch (-1: unknown)",
                                value=-1.0 if eta is None else eta)
        yield GaugeMetricFamily("swarmd_weights_fetch_sources", "Peers being fetched from", value=p.sources)
