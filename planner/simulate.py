"""A discrete-event simulation of prefill and decode over a Plan and a fleet.

Independent of the planner's cost model: it replays every token, block by block.

* Compute: each node is one FIFO server. A job's time is a roofline, max(FLOPs / FLOP/s,
  bytes / bandwidth), over the node's descriptor rates (measured by a daemon, or a fleet profile).
  With batching on, a node that becomes free takes every queued job of the same kind and block at
  once: the weights are read once for the batch, each request's KV separately.
* MoE: each token's router draws top-k distinct experts (uniformly, or by `expert_load`) with a
  seeded generator; the stage sends each holder (the first one the plan lists) the hidden states
  of the tokens routed to it, the holder runs them as one job, and replies; the block goes on when
  the last reply is in.
* Network: every message queues on its sender's uplink (bytes x 8 / uplink), then takes half the
  RTT plus a per-message software overhead. A `LinkModel` can replace that, e.g. with the delay
  and bandwidth a link emulator imposes, so the same run can be compared with a real swarm.
* Streams: `streams` requests start together, each prefills `prompt_tokens` and decodes
  `decode_tokens`; the sampled token goes back to stage 0 for the next step.
* Speculative decoding (optional): a draft proposes `speculative_tokens` tokens at stage 0
  (`draft_ms_per_token` each), the chain verifies all of them plus one in a single pass (every
  verified token routes to its own experts), and each draft token is accepted with probability
  `acceptance` until the first rejection: a round yields 1 to k+1 tokens.

The result has per-stream and aggregate decode tokens/s, time to first token, each node's compute
and uplink utilisation, the busiest resource, and where a token's time went on average.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from planner.layout import ModelLayout
from planner.node import NodeDescriptor
from planner.plan import Plan
from planner.topology import rtt_matrix


class LinkModel(Protocol):
    """Time from handing `nbytes` to the link until they arrive, excluding uplink queueing."""

    def transfer_ms(self, src: str, dst: str, nbytes: int) -> float: ...

    def latency_ms(self, src: str, dst: str) -> float: ...


@dataclass(frozen=True)
class SimConfig:
    streams: int = 4
    prompt_tokens: int = 128
    decode_tokens: int = 32
    batching: bool = True
    max_batch: int = 64
    # Software cost of one message, as in PlanOptions.hop_overhead_ms (py-libp2p 0.8.1 on loopback:
    # docs/BENCHMARKS.md, "Per-hop latency").
    hop_overhead_ms: float = 1.0
    default_rtt_ms: float = 1.0
    seed: int = 0
    expert_load: dict[int, Sequence[float]] = field(default_factory=dict)
    speculative_tokens: int = 0
    acceptance: float = 0.7
    draft_ms_per_token: float = 0.0
    max_events: int = 5_000_000  # a bound on every run


@dataclass(frozen=True)
class SimResult:
    stream_tokens_per_s: float  # median over streams, decode
    aggregate_tokens_per_s: float  # all decode tokens / decode makespan
    token_latency_ms: float  # mean time per decoded token over the streams (decode time / tokens)
    p90_token_latency_ms: float  # 90th percentile of a step's time per token it yielded
    first_token_ms: float  # median time to first token (prefill and the first sample)
    compute_utilisation: dict[str, float]
    uplink_utilisation: dict[str, float]
    bottleneck: str
    breakdown_ms: dict[str, float]  # mean per decode token: compute, queue, experts, hops
    events: int
    mean_batch: float


class _Job:
    __slots__ = ("done", "enqueued", "experts", "flops", "key", "kv_bytes", "stream", "weight_bytes")

    def __init__(self, key: tuple, flops: float, weight_bytes: float, kv_bytes: float,
                 done: Callable[[], None], stream: _Stream | None, experts: frozenset[int] = frozenset()):
        self.key, self.flops, self.weight_bytes, self.kv_bytes = key, flops, weight_bytes, kv_bytes
        self.done, self.stream, self.experts, self.enqueued = done, stream, experts, 0.0


@dataclass
class _Stream:
    sid: int
    context: int = 0
    tokens: int = 0  # tokens this step carries (prompt for prefill, 1 for decode)
    decoded: int = 0
    step_start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    yielded: list[int] = field(default_factory=list)  # tokens each round produced
    first_token: float = 0.0
    acc: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("compute", "queue", "experts", "hops"), 0.0))


class Simulator:
    def __init__(self, plan: Plan, layout: ModelLayout, nodes: Sequence[NodeDescriptor],
                 config: SimConfig | None = None, link: LinkModel | None = None):
        self.cfg = config or SimConfig()
        self.plan, self.layout, self.link = plan, layout, link
        self.nodes = sorted(nodes, key=lambda n: n.peer_id)
        self.idx = {n.peer_id: i for i, n in enumerate(self.nodes)}
        self.peers = [n.peer_id for n in self.nodes]
        self.flops = np.array([max(n.flops, 1.0) for n in self.nodes])
        self.bw = np.array([max(n.mem_bandwidth, 1.0) for n in self.nodes])
        self.uplink = np.array([max(n.uplink_bps, 1.0) for n in self.nodes])
        self.rtt = rtt_matrix(self.nodes, self.cfg.default_rtt_ms)
        self.stages = [(self.idx[s.peer_id], s.layers[0], s.layers[1]) for s in plan.stages]
        self.holder = {b: np.array([self.idx[by[x][0]] for x in sorted(by)]) for b, by in plan.experts.items()}
        self.rng = np.random.default_rng(self.cfg.seed)
        n = len(self.nodes)
        self.queue: list[deque[_Job]] = [deque() for _ in range(n)]
        self.busy = np.zeros(n, dtype=bool)
        self.busy_ms = np.zeros(n)
        self.uplink_free = np.zeros(n)
        self.uplink_ms = np.zeros(n)
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.events = 0
        self.batches = 0
        self.batched_jobs = 0

    # --- the event loop ------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn))

    def run(self) -> SimResult:
        streams = [_Stream(i) for i in range(self.cfg.streams)]
        for s in streams:
            s.tokens, s.context = max(1, self.cfg.prompt_tokens), 0
            self.at(0.0, functools.partial(self._start_step, s))
        while self.heap:
            self.events += 1
            if self.events > self.cfg.max_events:
                raise RuntimeError(f"simulation exceeded {self.cfg.max_events} events")
            self.now, _, fn = heapq.heappop(self.heap)
            fn()
        return self._result(streams)

    # --- compute ----------------------------------------------------------------------------
    def _submit(self, node: int, job: _Job) -> None:
        job.enqueued = self.now
        self.queue[node].append(job)
        if not self.busy[node]:
            self._serve(node)

    def _serve(self, node: int) -> None:
        q = self.queue[node]
        if not q:
            self.busy[node] = False
            return
        first = q.popleft()
        batch = [first]
        if self.cfg.batching and q:
            keep: deque[_Job] = deque()
            while q:
                j = q.popleft()
                (batch if j.key == first.key and len(batch) < self.cfg.max_batch else keep).append(j)
            self.queue[node] = keep
        flops = sum(j.flops for j in batch)
        if first.experts:
            moe = self.layout.blocks[first.key[1]].moe
            assert moe is not None
            weights = len(frozenset().union(*(j.experts for j in batch))) * moe.bytes_per_expert
        else:
            weights = first.weight_bytes
        nbytes = weights + sum(j.kv_bytes for j in batch)
        service = max(flops / self.flops[node], nbytes / self.bw[node]) * 1e3
        self.busy[node] = True
        self.busy_ms[node] += service
        self.batches += 1
        self.batched_jobs += len(batch)
        for j in batch:
            if j.stream is not None:
                j.stream.acc["queue"] += self.now - j.enqueued
                j.stream.acc["compute"] += service

        def finish() -> None:
            for j in batch:
                j.done()
            self._serve(node)

        self.at(self.now + service, finish)

    # --- network ------------------------------------------------------------------------------
    def _send(self, src: int, dst: int, nbytes: float, then: Callable[[], None]) -> None:
        if src == dst:
            then()
            return
        a, b = self.peers[src], self.peers[dst]
        if self.link is not None:
            wire = self.link.transfer_ms(a, b, int(nbytes))
            latency = self.link.latency_ms(a, b)
        else:
            wire = nbytes * 8 / self.uplink[src] * 1e3
            latency = self.rtt[src, dst] / 2 + self.cfg.hop_overhead_ms
        start = max(self.now, self.uplink_free[src])
        self.uplink_free[src] = start + wire
        self.uplink_ms[src] += wire
        self.at(start + wire + latency, then)

    # --- a stream's step through the chain -------------------------------------------------------
    def _start_step(self, s: _Stream) -> None:
        s.step_start = self.now
        _, a, _ = self.stages[0]
        draft = self.cfg.draft_ms_per_token * self.cfg.speculative_tokens if s.decoded or s.token_times else 0.0
        if draft:
            s.acc["compute"] += draft
            self.at(self.now + draft, lambda: self._block(s, 0, a))
        else:
            self._block(s, 0, a)

    def _block(self, s: _Stream, si: int, blk: int) -> None:
        node, _, end = self.stages[si]
        if blk == end:
            self._stage_done(s, si)
            return
        b = self.layout.blocks[blk]
        t, ctx = s.tokens, s.context
        # Attention over the context so far plus, in prefill, the causal half of the prompt.
        attn = b.attn_flops_per_context_token * (t * ctx + t * (t - 1) / 2)
        job = _Job(("dense", blk), b.flops_per_token * t + attn, b.param_bytes, b.kv_bytes_per_token * (ctx + t),
                   lambda: self._after_dense(s, si, blk), s)
        self._submit(node, job)

    def _after_dense(self, s: _Stream, si: int, blk: int) -> None:
        moe = self.layout.blocks[blk].moe
        if moe is None:
            self._block(s, si, blk + 1)
            return
        stage = self.stages[si][0]
        picks = self._route(blk, s.tokens, moe.n_experts, moe.top_k)  # (tokens, k)
        holders = self.holder[blk][picks]
        targets = np.unique(holders)
        pending = [len(targets)]
        started = self.now
        act = self.layout.blocks[blk].activation_bytes

        def reply() -> None:
            pending[0] -= 1
            if pending[0] == 0:
                s.acc["experts"] += self.now - started
                self._block(s, si, blk + 1)

        for node in targets.tolist():
            mine = holders == node
            n_tok = int(mine.any(axis=1).sum())
            experts = frozenset(picks[mine].tolist())
            flops = float(mine.sum()) * moe.flops_per_expert_token

            def run(node: int = node, n_tok: int = n_tok, experts: frozenset[int] = experts, flops: float = flops) -> None:
                job = _Job(("expert", blk), flops, 0.0, 0.0,
                           lambda: self._send(node, stage, n_tok * act, reply), None, experts)
                self._submit(node, job)

            self._send(stage, node, n_tok * act, run)

    def _route(self, blk: int, tokens: int, n_experts: int, k: int) -> np.ndarray:
        load = self.cfg.expert_load.get(blk)
        weights = np.log(np.asarray(load, dtype=float) + 1e-12) if load is not None else np.zeros(n_experts)
        # Top-k of log-weights plus Gumbel noise: k draws without replacement, weighted.
        noisy = weights[None, :] + self.rng.gumbel(size=(tokens, n_experts))
        return np.argpartition(-noisy, k - 1, axis=1)[:, :k]

    def _stage_done(self, s: _Stream, si: int) -> None:
        node, _, end = self.stages[si]
        if si + 1 < len(self.stages):
            nxt, a, _ = self.stages[si + 1]
            sent = self.now
            act = self.layout.blocks[end - 1].activation_bytes * s.tokens

            def arrive() -> None:
                s.acc["hops"] += self.now - sent
                self._block(s, si + 1, a)

            self._send(node, nxt, act, arrive)
            return
        head = _Job(("head", -1), self.layout.head_flops_per_token, self.layout.head_bytes, 0.0,
                    lambda: self._token(s), s)
        self._submit(node, head)

    def _token(self, s: _Stream) -> None:
        if not s.token_times:  # the prefill's token
            s.first_token = self.now
            s.context += s.tokens
            produced = 1
        else:
            produced = self._accepted(s.tokens - 1) + 1
            produced = min(produced, self.cfg.decode_tokens - s.decoded)
            s.context += produced
            s.decoded += produced
            s.yielded.append(produced)
        s.token_times.append(self.now)
        s.tokens = 1 + self.cfg.speculative_tokens
        if s.decoded >= self.cfg.decode_tokens:
            return
        if s.decoded == 0:  # time before the first decode step is prefill, not decode
            s.acc = dict.fromkeys(s.acc, 0.0)
        last, first = self.stages[-1][0], self.stages[0][0]
        sent = self.now

        def back() -> None:
            s.acc["hops"] += self.now - sent
            self._start_step(s)

        self._send(last, first, 8, back)

    def _accepted(self, drafted: int) -> int:
        """Draft tokens accepted before the first rejection."""
        n = 0
        while n < drafted and self.rng.random() < self.cfg.acceptance:
            n += 1
        return n

    # --- results --------------------------------------------------------------------------------
    def _result(self, streams: list[_Stream]) -> SimResult:
        gaps = np.concatenate([np.diff(s.token_times) / np.array(s.yielded) for s in streams
                               if len(s.token_times) > 1] or [np.zeros(0)])
        rates = [s.decoded / ((s.token_times[-1] - s.token_times[0]) / 1e3)
                 for s in streams if s.decoded and s.token_times[-1] > s.token_times[0]]
        start = min(s.token_times[0] for s in streams)
        end = max(s.token_times[-1] for s in streams)
        total = sum(s.decoded for s in streams)
        makespan = max(self.now, 1e-9)
        comp = {self.peers[i]: float(self.busy_ms[i] / makespan) for i in range(len(self.peers)) if self.busy_ms[i]}
        up = {self.peers[i]: float(self.uplink_ms[i] / makespan) for i in range(len(self.peers)) if self.uplink_ms[i]}
        worst_c = max(comp.items(), key=lambda kv: kv[1], default=("", 0.0))
        worst_u = max(up.items(), key=lambda kv: kv[1], default=("", 0.0))
        what, (peer, u) = ("compute", worst_c) if worst_c[1] >= worst_u[1] else ("uplink", worst_u)
        breakdown = {k: float(np.mean([s.acc[k] / max(s.decoded, 1) for s in streams])) for k in streams[0].acc}
        top = max(breakdown.items(), key=lambda kv: kv[1])
        per_token = sum(breakdown.values())
        bottleneck = (f"{top[0]} {top[1]:.3g} of {per_token:.3g} ms per token; busiest: {what} of {peer} "
                      f"({u:.0%} busy)")
        return SimResult(
            stream_tokens_per_s=float(np.median(rates)) if rates else 0.0,
            aggregate_tokens_per_s=total / ((end - start) / 1e3) if end > start else 0.0,
            token_latency_ms=float(np.mean([1e3 / r for r in rates])) if rates else 0.0,
            p90_token_latency_ms=float(np.quantile(gaps, 0.9)) if len(gaps) else 0.0,
            first_token_ms=float(np.median([s.first_token for s in streams])),
            compute_utilisation=comp,
            uplink_utilisation=up,
            bottleneck=bottleneck,
            breakdown_ms=breakdown,
            events=self.events,
            mean_batch=self.batched_jobs / max(self.batches, 1),
        )


def simulate(plan: Plan, layout: ModelLayout, nodes: Sequence[NodeDescriptor], config: SimConfig | None = None,
             link: LinkModel | None = None) -> SimResult:
    """Run `plan` over `nodes` event by event; see the module docstring for what is modelled."""
    return Simulator(plan, layout, nodes, config, link).run()


def percent_error(predicted: float, measured: float) -> float:
    """Signed error of a prediction against a measurement, in percent of the measurement."""
    return (predicted - measured) / measured * 100.0
