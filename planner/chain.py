"""Exact dynamic programmes that cut blocks [lo, hi) into contiguous stages over ordered nodes.

The nodes come in chain order (from `planner.topology`); a stage is a node taking the next run of
blocks. Two objectives, run one after the other for the balanced policy:

1. `min_bottleneck`: the smallest possible busiest-stage time per token (compute or uplink), the
   limit on throughput. O(K x J^2) for K nodes and J blocks.
2. `min_latency`: the smallest token latency (stage times plus hops) among partitions whose every
   stage stays under a cap; ties go to the most even stages (smallest sum of squared busy times).
   With `require_all` every node takes a stage, in order; otherwise nodes may be skipped and the hop
   from the previous stage's node is exact: O(K^2 x J + K x J^2).

Both are exact for the given order; choosing the order is the heuristic part (a short RTT tour).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

INF = float("inf")


@dataclass(frozen=True)
class ChainCosts:
    """Costs over nodes in chain order (position k) and blocks lo..hi-1 (local index 0..J-1)."""

    lat: np.ndarray  # (K, J) latency each block adds on each node (compute, fan-out)
    busy_compute: np.ndarray  # (K, J) compute busy time per token
    busy_uplink: np.ndarray  # (K, J) uplink busy time per token (expert fan-out sends)
    out_uplink: np.ndarray  # (K,) uplink time of sending the stage's activation on
    head: np.ndarray  # (K,) head time, added to the stage that ends at the model's last block
    has_head: bool  # hi is the model's last block
    hop: np.ndarray  # (K, K) hop latency from position a to b
    need: np.ndarray  # (J+1, J+1) bytes of a stage over [a, b); inf where b <= a
    free: np.ndarray  # (K,) bytes each node can give a stage

    @property
    def k(self) -> int:
        return self.lat.shape[0]

    @property
    def j(self) -> int:
        return self.lat.shape[1]

    def _span(self, per_block: np.ndarray, k: int, head: bool) -> np.ndarray:
        prefix = np.concatenate([[0.0], np.cumsum(per_block[k])])
        m = prefix[None, :] - prefix[:, None]
        if head and self.has_head:
            m[:, -1] += self.head[k]
        return m

    def stage_busy(self, k: int) -> np.ndarray:
        """(J+1, J+1): busy time of node k as the stage [a, b), inf where impossible."""
        busy = np.maximum(self._span(self.busy_compute, k, True),
                          self._span(self.busy_uplink, k, False) + self.out_uplink[k])
        busy[self.need > self.free[k]] = INF
        return busy

    def stage_lat(self, k: int) -> np.ndarray:
        lat = self._span(self.lat, k, True)
        lat[self.need > self.free[k]] = INF
        return lat


def min_bottleneck(c: ChainCosts, require_all: bool) -> float:
    """The smallest achievable max stage busy time covering every block (inf if none)."""
    if require_all and c.k > c.j:
        return INF
    f = np.full(c.j + 1, INF)
    f[0] = 0.0
    for k in range(c.k):
        g = np.maximum(f[:, None], c.stage_busy(k)).min(axis=0)
        f = g if require_all else np.minimum(f, g)
    return float(f[-1])


def min_latency(c: ChainCosts, cap: float, require_all: bool) -> list[tuple[int, int, int]] | None:
    """Stages (position, a, b) of least latency with every stage's busy time <= cap; None if none."""
    if require_all:
        return _latency_all(c, cap)
    return _latency_skip(c, cap)


def _latency_all(c: ChainCosts, cap: float) -> list[tuple[int, int, int]] | None:
    if c.k > c.j:
        return None
    v = np.full(c.j + 1, INF)
    v[0] = 0.0
    sq = np.zeros(c.j + 1)
    cols = np.arange(c.j + 1)
    parents = []
    for k in range(c.k):
        busy = c.stage_busy(k)
        lat = c.stage_lat(k)
        lat[busy > cap] = INF
        hop = c.hop[k - 1, k] if k else 0.0
        total = v[:, None] + lat + hop
        best = total.min(axis=0)
        tie = total <= best + 1e-9 * np.maximum(1.0, np.abs(best))
        second = np.where(tie & np.isfinite(total), sq[:, None] + np.where(np.isfinite(busy), busy, 0) ** 2, INF)
        arg = second.argmin(axis=0)
        sq = sq[arg] + np.where(np.isfinite(busy[arg, cols]), busy[arg, cols], 0) ** 2
        v = best
        parents.append(arg)
    if not np.isfinite(v[-1]):
        return None
    stages, j = [], c.j
    for k in range(c.k - 1, -1, -1):
        a = int(parents[k][j])
        stages.append((k, a, j))
        j = a
    return stages[::-1]


def _latency_skip(c: ChainCosts, cap: float) -> list[tuple[int, int, int]] | None:
    kk, jj = c.k, c.j
    vals = np.full((kk, jj + 1), INF)  # node k is the last stage so far and ends at block j
    from_j = np.zeros((kk, jj + 1), dtype=np.int64)
    from_k = np.full((kk, jj + 1), -1, dtype=np.int64)
    cols = np.arange(jj + 1)
    for k in range(kk):
        busy = c.stage_busy(k)
        lat = c.stage_lat(k)
        lat[busy > cap] = INF
        if k:
            arrive = vals[:k] + c.hop[:k, k][:, None]  # (k, J+1)
            prev_k = arrive.argmin(axis=0)
            w = arrive[prev_k, cols]
        else:
            prev_k = np.full(jj + 1, -1)
            w = np.full(jj + 1, INF)
        w[0], prev_k[0] = 0.0, -1  # node k opens the chain
        total = w[:, None] + lat
        arg = total.argmin(axis=0)
        vals[k] = total[arg, cols]
        from_j[k] = arg
        from_k[k] = prev_k[arg]
    last = int(np.argmin(vals[:, jj]))
    if not np.isfinite(vals[last, jj]):
        return None
    stages, k, j = [], last, jj
    while k >= 0:
        a = int(from_j[k, j])
        stages.append((k, a, j))
        k, j = int(from_k[k, j]), a
    return stages[::-1]


def furthest_cover(c: ChainCosts) -> int:
    """How many blocks the best chain can cover at all (for the error message when it is not J)."""
    reach = np.zeros(c.j + 1, dtype=bool)
    reach[0] = True
    for k in range(c.k):
        ok = np.isfinite(c.stage_lat(k))
        reach = reach | (reach[:, None] & ok).any(axis=0)
    return int(np.flatnonzero(reach).max())


def positions_to_nodes(stages: Sequence[tuple[int, int, int]], order: Sequence[int], lo: int) -> list[tuple[int, int, int]]:
    return [(order[k], lo + a, lo + b) for k, a, b in stages]
