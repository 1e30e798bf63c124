"""The planner's cost model: what a token costs on each node and link, and a plan's prediction.

Per block and node, decode time is a roofline: max(FLOPs / node FLOP/s, bytes read / node memory
bandwidth), where the bytes are the block's weights (experts apart) plus the KV of the context so
far. A hop costs half the RTT, the software overhead of one message and the activation's transfer
time on the sender's uplink. An MoE block waits for the slowest node its token's top-k experts
land on; with uniform routing over E experts, the chance that none of M given experts is picked
is C(E-M, k) / C(E, k), which gives the expected maximum exactly (see `expected_fanout`).
The simulator (`planner.simulate`) does not use any of this: it replays tokens event by event.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.layout import ModelLayout
from planner.node import NodeDescriptor
from planner.options import PlanOptions
from planner.plan import Prediction
from planner.topology import Topology

# Expert holders per expert, preferred (nearest to the block's stage) first.
Holders = list[tuple[int, ...]]


@dataclass
class Draft:
    """A candidate plan over node indices (into the peer-id-sorted node list)."""

    stages: list[tuple[int, int, int]]  # (node, start, end)
    experts: dict[int, Holders] = field(default_factory=dict)
    mode: str = "dense"  # dense | spread (experts over the group) | local (experts with their stage)
    notes: list[str] = field(default_factory=list)


@dataclass
class Evaluation:
    prediction: Prediction
    stage_ms: list[float]  # per stage: its blocks, fan-outs and head, per token
    hop_ms: float
    fanout_ms: float
    busy_ms: np.ndarray  # per node: busy time per token at full load (max of compute and uplink)
    latency_ms: float

    def score(self, policy: str) -> tuple[float, float]:
        """Lower is better. balanced: the busiest node's time per token (the throughput limit)
        first; min-latency: the token latency first."""
        busiest = float(self.busy_ms.max(initial=0.0))
        return (busiest, self.latency_ms) if policy == "balanced" else (self.latency_ms, busiest)


class CostModel:
    def __init__(self, layout: ModelLayout, nodes: Sequence[NodeDescriptor], opts: PlanOptions, topo: Topology):
        self.layout, self.nodes, self.opts, self.topo = layout, nodes, opts, topo
        flops = np.array([max(n.flops, 1.0) for n in nodes])
        bw = np.array([max(n.mem_bandwidth, 1.0) for n in nodes])
        self.uplink_bps = np.array([max(n.uplink_bps, 1.0) for n in nodes])
        ctx = opts.decode_context
        blocks = layout.blocks
        b_flops = np.array([b.flops_per_token + b.attn_flops_per_context_token * ctx for b in blocks], dtype=float)
        b_bytes = np.array([b.param_bytes + b.kv_bytes_per_token * ctx for b in blocks], dtype=float)
        self.block_ms = np.maximum(b_flops[None, :] / flops[:, None], b_bytes[None, :] / bw[:, None]) * 1e3
        e_flops = np.array([b.moe.flops_per_expert_token if b.moe else 0 for b in blocks], dtype=float)
        e_bytes = np.array([b.moe.bytes_per_expert if b.moe else 0 for b in blocks], dtype=float)
        self.expert_ms = np.maximum(e_flops[None, :] / flops[:, None], e_bytes[None, :] / bw[:, None]) * 1e3
        self.top_k = np.array([b.moe.top_k if b.moe else 0 for b in blocks])
        self.head_ms = np.maximum(layout.head_flops_per_token / flops, layout.head_bytes / bw) * 1e3
        self.act_bytes = np.array([b.activation_bytes for b in blocks], dtype=float)
        # Transfer of one hidden state on each node's uplink (the widest activation of the model).
        self.act_ms = float(self.act_bytes.max(initial=0.0)) * 8 / self.uplink_bps * 1e3
        self.relayed = relayed_pairs(nodes)

    # --- links ----------------------------------------------------------------------------
    def hop_ms(self, u: int, v: int, nbytes: float) -> float:
        """Half the RTT, one message's overhead and the transfer on the sender's uplink; a hop through a relay is
        two hops: its measured RTT already runs through the relay, and the overhead and transfer come twice."""
        if u == v:
            return 0.0
        one = self.opts.hop_overhead_ms + nbytes * 8 / self.uplink_bps[u] * 1e3
        return float(self.topo.rtt[u, v]) / 2 + one * (2 if self.relayed[u, v] else 1)

    def hop_matrix(self, order: Sequence[int]) -> np.ndarray:
        """(K, K) latency of an activation hop between nodes in `order` (sender is the row)."""
        idx = np.asarray(order)
        one = self.opts.hop_overhead_ms + self.act_ms[idx][:, None]
        m = self.topo.rtt[np.ix_(idx, idx)] / 2 + one * (1 + self.relayed[np.ix_(idx, idx)])
        np.fill_diagonal(m, 0.0)
        return m

    # --- estimates for the chain DP ----------------------------------------------------------
    def spread_fanout_estimate(self) -> tuple[np.ndarray, np.ndarray]:
        """Per (node, block): the expected fan-out latency when the block's experts are spread over
        the node's low-latency group, and the expected number of remote nodes it sends to.

        Only the chain DP uses this; a plan's prediction uses its real placement."""
        n, nb = self.block_ms.shape
        lat = np.zeros((n, nb))
        sends = np.zeros((n, nb))
        moe = self.top_k > 0
        if not moe.any():
            return lat, sends
        k = self.top_k
        for members in self.topo.groups:
            idx = np.asarray(members)
            size = len(idx)
            if size == 1:
                lat[idx[0]] = k * self.expert_ms[idx[0]]
                continue
            # A node's own RTT (0) sorts first in its row: the rest are its RTTs to the others.
            to_others = np.sort(self.topo.rtt[np.ix_(idx, idx)], axis=1)[:, 1:]
            far = np.quantile(to_others, 0.9, axis=1)
            back = float(np.median(self.act_ms[idx]))
            hit = np.minimum(k, size).astype(float)  # distinct nodes one token reaches
            per_hit = np.ceil(k / np.maximum(hit, 1)) * np.median(self.expert_ms[idx], axis=0)
            lat[idx] = (far + 2 * self.opts.hop_overhead_ms + back)[:, None] \
                + hit[None, :] * self.act_ms[idx][:, None] + per_hit[None, :]
            sends[idx] = hit * (size - 1) / size
        lat[:, ~moe] = 0.0
        sends[:, ~moe] = 0.0
        return lat, sends

    # --- the expected fan-out of one MoE block -------------------------------------------------
    def expected_fanout(self, block: int, stage: int, holders: Holders) -> tuple[float, float, np.ndarray]:
        """(expected latency ms, expected remote nodes reached, expected experts run per node).

        Each token picks top_k distinct experts; it goes to every expert's preferred holder (the
        first). Node n is reached unless none of the M_n experts it is preferred for are picked:
        P = C(E - M_n, k) / C(E, k). Sorting nodes by their finish time t_n and summing
        t_i x P(max = t_i) gives E[max]. Non-uniform load weights M_n by the experts' load."""
        moe = self.layout.blocks[block].moe
        assert moe is not None
        e, k = moe.n_experts, moe.top_k
        load = self.opts.load_of(block, e) or [1.0] * e
        n = len(self.nodes)
        weight = np.asarray(load, dtype=float)
        first = np.fromiter((hs[0] for hs in holders), dtype=np.int64, count=e)
        copies = np.fromiter((len(hs) for hs in holders), dtype=np.int64, count=e)
        mass = np.bincount(first, weights=weight, minlength=n)
        single = copies == 1
        runs = np.bincount(first[single], weights=weight[single] * k / e, minlength=n)
        for x in np.flatnonzero(~single):  # for throughput, replicas share their expert's tokens
            for h in holders[x]:
                runs[h] += k / e * weight[x] / copies[x]
        reached = np.flatnonzero(mass > 0)
        p_hit = 1.0 - _none_picked(mass[reached], e, k)
        expect_runs = k * mass[reached] / e
        per_hit = np.maximum(np.ceil(expect_runs / np.maximum(p_hit, 1e-12) - 1e-9), 1.0)
        remote = reached != stage
        t = per_hit * self.expert_ms[reached, block]
        t = t + remote * (self.topo.rtt[stage, reached] + 2 * self.opts.hop_overhead_ms + self.act_ms[reached])
        sends = float(np.sum(p_hit[remote]))
        order = np.argsort(-t, kind="stable")
        none_before = _none_picked(np.cumsum(mass[reached][order]), e, k)
        prev = np.concatenate([[1.0], none_before[:-1]])
        expect_max = float(np.sum(t[order] * (prev - none_before)))
        return expect_max + sends * float(self.act_ms[stage]), sends, runs

    # --- a whole plan ------------------------------------------------------------------------
    def evaluate(self, draft: Draft) -> Evaluation:
        layout, nb = self.layout, self.layout.n_blocks
        n = len(self.nodes)
        compute = np.zeros(n)
        uplink = np.zeros(n)
        stage_ms, fanout_total = [], 0.0
        terms: list[tuple[float, str]] = []
        for i, (node, a, b) in enumerate(draft.stages):
            ms = float(self.block_ms[node, a:b].sum())
            compute[node] += ms
            fan = 0.0
            for blk in range(a, b):
                if layout.blocks[blk].moe is None:
                    continue
                f, sends, runs = self.expected_fanout(blk, node, draft.experts[blk])
                fan += f
                compute += runs * self.expert_ms[:, blk]
                uplink[node] += sends * self.act_ms[node]
                uplink += (runs > 0) * np.minimum(runs, 1.0) * self.act_ms * (np.arange(n) != node)
            if b == nb:
                ms += float(self.head_ms[node])
                compute[node] += float(self.head_ms[node])
            if i + 1 < len(draft.stages):
                uplink[node] += self.act_ms[node]
            stage_ms.append(ms + fan)
            fanout_total += fan
            terms.append((ms, f"compute on {self.nodes[node].peer_id} (blocks {a}-{b - 1})"))
        hops = 0.0
        for (u, _, b), (v, _, _) in itertools.pairwise(draft.stages):
            hops += self.hop_ms(u, v, self.act_bytes[b - 1])
        if len(draft.stages) > 1:  # the sampled token goes back to stage 0: a few bytes
            hops += self.hop_ms(draft.stages[-1][0], draft.stages[0][0], 8)
        latency = float(sum(stage_ms) + hops)
        if fanout_total:
            terms.append((fanout_total, f"expert fan-out ({len(layout.moe_blocks())} MoE blocks)"))
        if hops:
            terms.append((hops, f"network hops ({len(draft.stages)} per token)"))
        busy = np.maximum(compute, uplink)
        per_stream = 1e3 / latency if latency > 0 else 0.0
        worst = int(np.argmax(busy))
        by_load = 1e3 / busy[worst] if busy[worst] > 0 else float("inf")
        aggregate = min(self.opts.concurrency * per_stream, by_load)
        top_ms, top = max(terms, key=lambda t: t[0])
        bottleneck = f"{top}: {top_ms:.3g} of {latency:.3g} ms per token"
        if by_load < self.opts.concurrency * per_stream:
            what = "uplink" if uplink[worst] > compute[worst] else "compute"
            bottleneck += f"; at {self.opts.concurrency} streams, {what} of {self.nodes[worst].peer_id}"
        prediction = Prediction(
            token_latency_ms=_round(latency),
            stream_tokens_per_s=_round(per_stream),
            aggregate_tokens_per_s=_round(aggregate),
            bottleneck=bottleneck,
            saturated_tokens_per_s=_round(by_load) if np.isfinite(by_load) else 0.0,
        )
        return Evaluation(prediction, stage_ms, hops, fanout_total, busy, latency)


def _none_picked(mass: np.ndarray, e: int, k: int) -> np.ndarray:
    """P(none of `mass` experts among k distinct picks out of e) = prod_j (e - m - j) / (e - j)."""
    mass = np.asarray(mass, dtype=float)
    p = np.ones_like(mass)
    for j in range(k):
        p *= np.clip((e - mass - j) / (e - j), 0.0, 1.0)
    return p


def _round(x: float) -> float:
    """Six significant digits: plans compare equal across runs that differ in float noise."""
    return float(f"{x:.6g}")


def relayed_pairs(nodes: Sequence[NodeDescriptor]) -> np.ndarray:
    """(N, N) bool: the pairs whose activations go through a relay, as either end reports it."""
    index = {n.peer_id: i for i, n in enumerate(nodes)}
    out = np.zeros((len(nodes), len(nodes)), dtype=bool)
    for i, node in enumerate(nodes):
        for peer, kind in node.links.items():
            j = index.get(peer)
            if j is not None and kind == "relayed":
                out[i, j] = out[j, i] = True
    return out
