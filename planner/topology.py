"""The network as the planner sees it: a symmetric RTT matrix, low-latency groups, a chain order.

Nodes come in sorted by peer id; every tie below is broken by that index, so the same set of
nodes always gives the same groups and the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.node import NodeDescriptor

# Up to this many groups the tour over groups is found by trying every order (7! = 5040).
EXACT_TOUR_GROUPS = 8
# Up to this many, 2-opt moves improve the nearest-neighbour tour (O(n^2) per round, pure Python).
TWO_OPT_ITEMS = 100
NEIGHBOUR_FACTOR = 1.5


@dataclass(frozen=True)
class Topology:
    rtt: np.ndarray  # (N, N) symmetric, ms, zero diagonal
    groups: tuple[tuple[int, ...], ...]  # node indices per low-latency group, in tour order
    group_of: np.ndarray  # (N,) group position in `groups`
    order: tuple[int, ...]  # every node, groups in tour order, each group in its own tour order
    group_rtt: np.ndarray  # (G, G) median RTT between members of two groups (same order as `groups`)
    rank: np.ndarray  # (N,) position of each node in `order`

    @property
    def n(self) -> int:
        return len(self.group_of)


def rtt_matrix(nodes: Sequence[NodeDescriptor], default_ms: float) -> np.ndarray:
    """Symmetric RTTs from what each node reports: the larger of the two directions when both
    are known (a conservative guess), the one known, or `default_ms`."""
    index = {n.peer_id: i for i, n in enumerate(nodes)}
    get = index.get
    m = np.full((len(nodes), len(nodes) + 1), np.nan)  # the extra column takes unknown peers
    for i, node in enumerate(nodes):
        if node.rtt_ms:
            cols = np.fromiter([get(p, -1) for p in node.rtt_ms], dtype=np.int64, count=len(node.rtt_ms))
            m[i, cols] = np.fromiter(node.rtt_ms.values(), dtype=float, count=len(node.rtt_ms))
    m = m[:, :-1]
    m = np.fmax(m, m.T)
    m[np.isnan(m)] = default_ms
    np.fill_diagonal(m, 0.0)
    return np.maximum(m, 0.0)


def low_latency_groups(rtt: np.ndarray, threshold_ms: float) -> list[list[int]]:
    """Connected components of the graph whose edges are pairs closer than `threshold_ms`."""
    n = len(rtt)
    close = rtt <= threshold_ms
    seen = np.zeros(n, dtype=bool)
    groups = []
    for start in range(n):
        if seen[start]:
            continue
        member = np.zeros(n, dtype=bool)
        member[start] = True
        frontier = member.copy()
        while frontier.any():
            reach = close[frontier].any(axis=0) & ~member
            member |= reach
            frontier = reach
        seen |= member
        groups.append(np.flatnonzero(member).tolist())
    return groups


def _cycle_length(order: Sequence[int], dist: np.ndarray) -> float:
    return float(sum(dist[order[i], order[(i + 1) % len(order)]] for i in range(len(order)))) if len(order) > 1 else 0.0


def tour(dist: np.ndarray, items: Sequence[int]) -> list[int]:
    """A short closed tour over `items` (indices into `dist`), starting at items[0].

    Exact for up to EXACT_TOUR_GROUPS items; nearest neighbour, then 2-opt moves, beyond.
    """
    items = list(items)
    if len(items) <= 3:
        return items
    if len(items) <= EXACT_TOUR_GROUPS:
        first, rest = items[0], items[1:]
        best = min(itertools.permutations(rest), key=lambda p: _cycle_length((first, *p), dist))
        return [first, *best]
    sub = dist[np.ix_(items, items)]
    left = np.ones(len(items), dtype=bool)
    path = [0]
    left[0] = False
    for _ in range(len(items) - 1):
        row = np.where(left, sub[path[-1]], np.inf)
        nxt = int(np.argmin(row))  # first minimum: the lowest index wins a tie
        path.append(nxt)
        left[nxt] = False
    if len(items) <= TWO_OPT_ITEMS:
        path = _two_opt(path, sub)
    return [items[i] for i in path]


def _two_opt(path: list[int], d: np.ndarray, max_rounds: int = 5) -> list[int]:
    n = len(path)
    for _ in range(max_rounds):
        improved = False
        for i in range(1, n - 1):
            for j in range(i + 1, n):
                a, b = path[i - 1], path[i]
                c, e = path[j], path[(j + 1) % n]
                if d[a, c] + d[b, e] < d[a, b] + d[c, e] - 1e-9:
                    path[i : j + 1] = reversed(path[i : j + 1])
                    improved = True
        if not improved:
            break
    return path


def group_threshold(rtt: np.ndarray, floor_ms: float) -> float:
    """Nodes closer than this form a group: `floor_ms`, or 1.5 x the median distance from a node to
    its nearest neighbour when that is larger (homes in one metro area are 10-20 ms apart, and
    are still each other's best neighbours)."""
    if len(rtt) < 2:
        return floor_ms
    nearest = np.where(np.eye(len(rtt), dtype=bool), np.inf, rtt).min(axis=1)
    return max(floor_ms, NEIGHBOUR_FACTOR * float(np.median(nearest)))


def build_topology(nodes: Sequence[NodeDescriptor], *, default_rtt_ms: float, group_rtt_ms: float) -> Topology:
    rtt = rtt_matrix(nodes, default_rtt_ms)
    groups = low_latency_groups(rtt, group_threshold(rtt, group_rtt_ms))
    # Distance between groups: the median RTT between their members.
    g = len(groups)
    gdist = np.zeros((g, g))
    for a in range(g):
        for b in range(a + 1, g):
            gdist[a, b] = gdist[b, a] = float(np.median(rtt[np.ix_(groups[a], groups[b])]))
    group_order = tour(gdist, range(g))
    # Inside a group RTTs are all low; order by them, but at a 1 ms resolution so that
    # measurement jitter does not reshuffle the chain (and move weights) between plans.
    coarse = np.floor(rtt)
    ordered_groups = [tuple(tour(coarse, groups[gi])) for gi in group_order]
    group_of = np.zeros(len(nodes), dtype=np.int64)
    for pos, members in enumerate(ordered_groups):
        group_of[list(members)] = pos
    order = tuple(i for members in ordered_groups for i in members)
    rank = np.zeros(len(nodes), dtype=np.int64)
    rank[list(order)] = np.arange(len(order))
    return Topology(rtt=rtt, groups=tuple(ordered_groups), group_of=group_of, order=order,
                    group_rtt=gdist[np.ix_(group_order, group_order)], rank=rank)
