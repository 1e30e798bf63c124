"""make_plan: the one entry point the leader and `swarmd plan` call.

Policies:

* balanced (default): every ready node takes a stage when there are no more nodes than blocks,
  layers in proportion to speed within memory (the exact min-bottleneck DP, then the least
  latency among partitions that reach it); with more nodes than blocks, every node holds a stage
  or experts. Its score is the busiest node's time per token: the throughput limit.
* min-latency: fewer, faster, closer nodes; a node is left out when its hop costs more than it
  saves. Its score is the token latency.

Both build several candidates (experts spread over the group or kept with their stage; one chain
over every node, or one per low-latency group in proportion to its memory; with `previous`, the
previous plan repaired for the nodes that left) and keep the best by the policy's score. The
previous plan wins ties and, when nodes were lost, anything within `replan_tolerance`, because
moving weights costs far more than a few percent of speed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from planner.chain import INF, ChainCosts, furthest_cover, min_bottleneck, min_latency, positions_to_nodes
from planner.cost import CostModel, Draft, Evaluation
from planner.errors import InfeasiblePlan, PlanSchemaError
from planner.experts import order_holders, place_local, place_spread, replicate_hot
from planner.fetch import FetchEstimate, fetch_estimate
from planner.holdings import Holdings, parse_holdings
from planner.layout import ModelLayout
from planner.memory import dense_bytes, expert_bytes, stage_need_matrix
from planner.node import NodeDescriptor
from planner.options import GiB, PlanOptions
from planner.plan import ModelRef, Plan, Stage, router_actor, stage_actor
from planner.standby import choose_standbys
from planner.sticky import repair
from planner.topology import build_topology

POLICIES = ("balanced", "min-latency")
# Groups tried as the seed of a min-latency chain (largest memory first).
MAX_SEED_GROUPS = 8
# Candidates this close to the best by the policy's score compete on the other score.
SCORE_SLACK = 0.05
# Reasons list every stage up to this many; beyond, a summary line.
MAX_STAGE_REASONS = 64

__all__ = ["POLICIES", "PlanOptions", "make_plan"]


def make_plan(
    layout: ModelLayout,
    nodes: Sequence[NodeDescriptor],
    *,
    policy: str = "balanced",
    epoch: int = 0,
    options: PlanOptions | None = None,
    previous: Plan | None = None,
) -> Plan:
    """Assign every block to a stage and every expert to a node. Deterministic in the set of nodes.

    Raises InfeasiblePlan (one line: what is missing) when the nodes cannot hold the model."""
    if policy not in POLICIES:
        raise PlanSchemaError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if layout.n_blocks == 0:
        raise PlanSchemaError("the model layout has no blocks")
    ordered = sorted_nodes(nodes)
    try:
        return Planner(layout, ordered, options or PlanOptions(), policy, previous).plan(epoch)
    except InfeasiblePlan:
        if not any(n.standby for n in ordered):
            raise
    # The others cannot hold the model: the spares hold stages like everyone else.
    plan = Planner(layout, ordered, options or PlanOptions(), policy, previous, reserve_standbys=False).plan(epoch)
    return replace(plan, reasons=("standby nodes run stages: the other nodes cannot hold the model", *plan.reasons))


def sorted_nodes(nodes: Sequence[NodeDescriptor]) -> list[NodeDescriptor]:
    """Nodes by peer id: every later tie is broken by this order, so input order never matters."""
    ordered = sorted(nodes, key=lambda n: n.peer_id)
    for a, b in itertools.pairwise(ordered):
        if a.peer_id == b.peer_id:
            raise PlanSchemaError(f"peer {a.peer_id} is listed twice")
    return ordered


class Planner:
    """One planning run: the nodes, their costs and every candidate."""

    def __init__(self, layout: ModelLayout, nodes: list[NodeDescriptor], opts: PlanOptions, policy: str,
                 previous: Plan | None = None, *, reserve_standbys: bool = True):
        if not nodes:
            raise InfeasiblePlan("no nodes to plan over")
        self.layout, self.nodes, self.opts, self.policy = layout, nodes, opts, policy
        self.previous = previous if previous is not None and _same_model(previous, layout) else None
        self.index = {n.peer_id: i for i, n in enumerate(nodes)}
        self.capacity = self._capacity()
        # Spares without a stage are kept out of every candidate (free 0): only the repair of a lost stage
        # and the standby copies use them (their real room is `capacity`). A spare already promoted to a
        # stage is a member like any other.
        holders = {s.peer_id for s in self.previous.stages} if self.previous else set()
        self.spares = [i for i, n in enumerate(nodes) if reserve_standbys and n.standby and n.peer_id not in holders]
        self.free = self.capacity.copy()
        self.free[self.spares] = 0.0
        self.ready = [i for i in range(len(nodes)) if self.free[i] > 0]
        if not self.ready:
            raise InfeasiblePlan(f"no node has memory beyond the {opts.runtime_overhead_bytes / GiB:.2f} GiB "
                                 "runtime overhead")
        self.topo = build_topology(nodes, default_rtt_ms=opts.default_rtt_ms, group_rtt_ms=opts.group_rtt_ms)
        self.cm = CostModel(layout, nodes, opts, self.topo)
        self.n_blocks = layout.n_blocks
        self.is_moe = layout.is_moe
        self.need = {"dense": stage_need_matrix(layout, opts)}
        if self.is_moe:
            self.need["spread"] = self.need["dense"]
            self.need["local"] = stage_need_matrix(layout, opts, with_experts=True)
            self.fan_lat, self.fan_sends = self.cm.spread_fanout_estimate()
        ready = set(self.ready)
        self.order = [i for i in self.topo.order if i in ready]
        self.holdings = [parse_holdings(n.holds) for n in nodes]
        self._check_capacity()

    # --- memory ---------------------------------------------------------------------------
    def _capacity(self) -> np.ndarray:
        """Bytes each node can give the plan, runtime overhead taken off: its free memory plus what
        the previous plan gave it (it lets that go when re-assigned), never above its total."""
        held = self._held_by_previous()
        return np.array([
            max(0, min(n.memory_total or n.memory_free, n.memory_free + held.get(n.peer_id, 0))
                - self.opts.runtime_overhead_bytes)
            for n in self.nodes
        ], dtype=float)

    def _held_by_previous(self) -> dict[str, int]:
        if self.previous is None:
            return {}
        from planner.memory import node_memory_use

        stages = [(s.peer_id, s.layers) for s in self.previous.stages] + list(self.previous.standbys.items())
        use = node_memory_use(self.layout, stages, self.previous.experts, self.opts)
        return {p: u - self.opts.runtime_overhead_bytes for p, u in use.items()}

    def _check_capacity(self) -> None:
        """Fail early, in one line, when no arrangement can fit: a block larger than any node, or
        more bytes than all nodes together."""
        largest = float(self.free.max())
        dense = dense_bytes(self.layout, self.opts)
        for b in range(self.n_blocks):
            need = dense[b] + (self.layout.embedding_bytes if b == 0 else 0) \
                + (self.layout.head_bytes if b == self.n_blocks - 1 else 0)
            if need > largest:
                raise InfeasiblePlan(f"needs {(need - largest) / GiB:.1f} GiB more memory for block {b} "
                                     f"(on one node: the largest has {largest / GiB:.1f} GiB to give)")
        per_block = dense + expert_bytes(self.layout)
        per_block[0] += self.layout.embedding_bytes
        per_block[-1] += self.layout.head_bytes
        total = float(self.free.sum())
        if per_block.sum() > total:
            covered = int(np.searchsorted(np.cumsum(per_block), total, side="right"))
            raise InfeasiblePlan(f"needs {(per_block.sum() - total) / GiB:.1f} GiB more memory for blocks "
                                 f"{_span(range(covered, self.n_blocks))}")

    # --- chains -----------------------------------------------------------------------------
    def chain_costs(self, order: Sequence[int], lo: int, hi: int, mode: str) -> ChainCosts:
        idx = np.asarray(order)
        cols = np.arange(lo, hi)
        cm = self.cm
        block = cm.block_ms[np.ix_(idx, cols)]
        zeros = np.zeros_like(block)
        if mode == "local":
            local = (cm.top_k[lo:hi] * cm.expert_ms[np.ix_(idx, cols)])
            lat, busy_c, busy_u = block + local, block + local, zeros
        elif mode == "spread":
            lat = block + self.fan_lat[np.ix_(idx, cols)]
            busy_c = block
            busy_u = self.fan_sends[np.ix_(idx, cols)] * cm.act_ms[idx][:, None]
        else:
            lat, busy_c, busy_u = block, block, zeros
        return ChainCosts(
            lat=lat, busy_compute=busy_c, busy_uplink=busy_u, out_uplink=cm.act_ms[idx],
            head=cm.head_ms[idx], has_head=hi == self.n_blocks, hop=cm.hop_matrix(order),
            need=self.need[mode][lo:hi + 1, lo:hi + 1], free=self.free[idx],
        )

    def chain(self, order: Sequence[int], lo: int, hi: int, mode: str, require_all: bool
              ) -> list[tuple[int, int, int]] | None:
        if not order:
            return None
        c = self.chain_costs(order, lo, hi, mode)
        cap = INF
        if self.policy == "balanced":
            best = min_bottleneck(c, require_all)
            if not np.isfinite(best):
                return None
            cap = best * (1 + 1e-9) + 1e-12
        stages = min_latency(c, cap, require_all)
        return positions_to_nodes(stages, order, lo) if stages else None

    def quota_chain(self, groups: Sequence[Sequence[int]], mode: str) -> list[tuple[int, int, int]] | None:
        """One chain per group, blocks split in proportion to each group's memory, so that the
        experts of a block can stay in its stage's group (a far node costs a round trip per block)."""
        per_block = dense_bytes(self.layout, self.opts) + expert_bytes(self.layout)
        cum = np.concatenate([[0.0], np.cumsum(per_block)])
        caps = np.array([self.free[list(g)].sum() for g in groups])
        bounds = [0]
        for frac in np.cumsum(caps)[:-1] / caps.sum():
            bounds.append(max(bounds[-1], int(np.argmin(np.abs(cum - frac * cum[-1])))))
        bounds.append(self.n_blocks)
        stages: list[tuple[int, int, int]] = []
        for members, lo, hi in zip(groups, bounds, bounds[1:], strict=False):
            if hi <= lo:
                continue
            part = self.chain(list(members), lo, hi, mode,
                              require_all=self.policy == "balanced" and len(members) <= hi - lo)
            if part is None:
                part = self.chain(list(members), lo, hi, mode, require_all=False)
            if part is None:
                return None
            stages.extend(part)
        return stages

    # --- candidates ---------------------------------------------------------------------------
    def group_sets(self) -> list[list[int]]:
        """min-latency: for each of the largest groups, it and the nearest groups until they can
        hold the model; balanced: every group."""
        groups = [[i for i in g if self.free[i] > 0] for g in self.topo.groups]
        live = [gi for gi, g in enumerate(groups) if g]
        if self.policy == "balanced" or len(live) == 1:
            return [live]
        total = float((dense_bytes(self.layout, self.opts) + expert_bytes(self.layout)).sum()
                      + self.layout.embedding_bytes + self.layout.head_bytes)
        cap = {gi: float(self.free[groups[gi]].sum()) for gi in live}
        seeds = sorted(live, key=lambda gi: (-cap[gi], gi))[:MAX_SEED_GROUPS]
        sets: list[list[int]] = []
        for seed in seeds:
            chosen, have = [seed], cap[seed]
            for gi in np.argsort(self.topo.group_rtt[seed], kind="stable"):
                if have >= total:
                    break
                if int(gi) in live and int(gi) not in chosen:
                    chosen.append(int(gi))
                    have += cap[int(gi)]
            key = sorted(chosen)
            if have >= total and key not in sets:
                sets.append(key)
        return sets or [live]

    def fresh(self) -> list[Draft]:
        drafts: list[Draft] = []
        modes = ["dense"]
        balanced = self.policy == "balanced"
        if self.is_moe and self.opts.expert_placement != "auto":
            modes = [self.opts.expert_placement]
        elif self.is_moe:
            # balanced spreads experts over all members (what a swarm of volunteers expects); min-latency
            # also weighs keeping them with their stages
            modes = ["spread"] if balanced else ["spread", "local"]
        for gset in self.group_sets():
            groups = [[i for i in self.topo.groups[g] if self.free[i] > 0] for g in gset]
            order = [i for g in groups for i in g]
            for mode in modes:
                # Nodes too small for even one block can only hold experts.
                capable = [i for i in order if self._holds_a_block(i, mode)]
                everyone = balanced and len(capable) <= self.n_blocks
                if mode == "local" and balanced and len(order) > self.n_blocks:
                    continue  # balanced gives every node a stage or experts: local leaves some idle
                chains: list[tuple[list[tuple[int, int, int]] | None, str]] = []
                if everyone:
                    small = len(order) - len(capable)
                    chains.append((self.chain(capable, 0, self.n_blocks, mode, True),
                                   f"every node a stage, {small} too small for one" if small else "every node a stage"))
                if not chains or chains[-1][0] is None:
                    chains.append((self.chain(order, 0, self.n_blocks, mode, False),
                                   "not every node could hold a stage" if everyone else "one chain"))
                elif mode == "spread":
                    # Members too slow to be worth a stage still work: they hold experts only.
                    chains.append((self.chain(order, 0, self.n_blocks, mode, False),
                                   "the fastest chain, the others holding experts"))
                if mode == "spread" and len(groups) > 1 and not everyone:
                    chains.append((self.quota_chain(groups, mode), "blocks split over groups by memory"))
                for stages, how in chains:
                    if stages is None:
                        continue
                    draft = self.with_experts(stages, mode)
                    if draft is not None:
                        draft.notes.append(how)
                        drafts.append(draft)
        return drafts

    def _holds_a_block(self, node: int, mode: str) -> bool:
        """Whether `node` can hold a stage of one block somewhere in the model."""
        need = self.need[mode]
        return bool(min(need[b, b + 1] for b in range(self.n_blocks)) <= self.free[node])

    def with_experts(self, stages: list[tuple[int, int, int]], mode: str) -> Draft | None:
        if mode == "dense":
            return Draft(stages=stages, mode=mode)
        if mode == "local":
            return Draft(stages=stages, experts=place_local(self.cm, stages), mode=mode)
        spare = self.free.copy()
        for node, a, b in stages:
            spare[node] -= self.need["dense"][a, b]
        try:
            experts = place_spread(self.cm, stages, spare, self.policy)
        except InfeasiblePlan:
            return None
        for blk, hs in experts.items():
            size = self.layout.blocks[blk].moe.bytes_per_expert  # type: ignore[union-attr]
            for h in hs:
                spare[h[0]] -= size
        experts, copies = replicate_hot(self.cm, stages, experts, spare)
        draft = Draft(stages=stages, experts=experts, mode=mode)
        if copies:
            draft.notes.append(f"{copies} replicas of hot experts")
        return draft

    # --- choosing ---------------------------------------------------------------------------------
    def plan(self, epoch: int) -> Plan:
        drafts = self.fresh()
        if not drafts:
            raise InfeasiblePlan(self._chain_shortfall())
        if self.policy == "balanced":
            # Every ready member holds something whenever some candidate manages that.
            drafts = [d for d in drafts if len(_used(d)) == len(self.ready)] or drafts
        drafts += [h for d in drafts if (h := self.holders_placed(d)) is not None]
        scored = [(self.cm.evaluate(d), d) for d in drafts]
        # The best by the policy's first score, unless one within SCORE_SLACK of it is much
        # better by the second (1 % more throughput is not worth 3x the latency). Between plans of equal
        # scores, the one that is ready first (its nodes hold more of what they are given).
        first = min(ev.score(self.policy)[0] for ev, _ in scored)
        near = [(ev, d) for ev, d in scored if ev.score(self.policy)[0] <= first * (1 + SCORE_SLACK) + 1e-12]
        best_eval, best = min(near, key=lambda ed: (*_key(ed[0].score(self.policy)[::-1]),
                                                     self.fetch(ed[1]).fetch_s))
        reasons = [f"policy {self.policy}: {len(drafts)} candidate plans; best: {self._describe(best)}"]
        if self.previous is not None:
            kept = repair(self, self.previous)
            if kept is not None:
                kept_eval = self.cm.evaluate(kept)
                take, why = self._prefer_previous(kept_eval, best_eval)
                reasons.append(why)
                if take:
                    best_eval, best = kept_eval, kept
                    reasons.append(f"repair: {', '.join(kept.notes)}")
        return self._to_plan(best, best_eval, epoch, reasons)

    # --- weights to fetch -------------------------------------------------------------------------------
    def fetch(self, d: Draft) -> FetchEstimate:
        return fetch_estimate(self.layout, self.nodes, self.holdings, d.stages, d.experts, self.opts)

    def holders_placed(self, d: Draft) -> Draft | None:
        """The same chain with its nodes moved so that the largest ranges go to the nodes that hold most of them
        (where they have room); None when that changes nothing. Dense drafts only: experts are placed per node."""
        if d.mode != "dense" or all(h.everything for h in self.holdings) or not any(h.anything for h in self.holdings):
            return None
        free = {node for node, _, _ in d.stages}
        placed: dict[int, int] = {}
        for pos in sorted(range(len(d.stages)), key=lambda p: -self._range_bytes(*d.stages[p][1:])):
            _, a, b = d.stages[pos]
            fits = [n for n in sorted(free) if self.need[d.mode][a, b] <= self.free[n]]
            if not fits:
                return None
            placed[pos] = max(fits, key=lambda n: (self._range_bytes(a, b, self.holdings[n]), -n))
            free.discard(placed[pos])
        stages = [(placed[p], a, b) for p, (_, a, b) in enumerate(d.stages)]
        if stages == d.stages:
            return None
        return Draft(stages=stages, experts=d.experts, mode=d.mode, notes=[*d.notes, "holders keep what they hold"])

    def _range_bytes(self, a: int, b: int, held: Holdings | None = None) -> float:
        """Bytes of blocks [a, b) with the embedding or head they carry; with `held`, only those it holds."""
        size = 0.0
        if a == 0 and (held is None or held.everything or held.embedding):
            size += self.layout.embedding_bytes
        if b == self.n_blocks and (held is None or held.everything or held.head):
            size += self.layout.head_bytes
        return size + sum(self.layout.blocks[x].param_bytes for x in range(a, b) if held is None or held.has_block(x))

    def _prefer_previous(self, kept: Evaluation, best: Evaluation) -> tuple[bool, str]:
        k, b = kept.score(self.policy)[0], best.score(self.policy)[0]
        gone = [p for p in self.previous.peers() if p not in self.index] if self.previous else []
        joined = [self.nodes[i].peer_id for i in self.ready if self.previous
                  and self.nodes[i].peer_id not in set(self.previous.peers())]
        metric = "busiest node ms/token" if self.policy == "balanced" else "token latency ms"
        if joined and not gone and self.policy == "balanced":
            # A new member gets a stage unless that makes the plan strictly worse.
            if k < b * (1 - 1e-9):
                return True, f"kept the current plan: using {len(joined)} new node(s) would not help ({metric} {k:.3g} vs {b:.3g})"
            return False, f"re-planned for {len(joined)} new node(s) ({metric} {b:.3g}, was {k:.3g})"
        tol = self.opts.replan_tolerance
        if k <= b * (1 + tol) + 1e-12:
            return True, (f"kept surviving nodes' assignments: within {tol:.0%} of the best plan "
                          f"({metric} {k:.3g} vs {b:.3g})")
        return False, f"moved assignments: keeping them costs {k / b - 1:.0%} ({metric} {k:.3g} vs {b:.3g})"

    def _chain_shortfall(self) -> str:
        """Why no chain exists although the totals fit: the blocks no chain can reach."""
        mode = "spread" if self.is_moe else "dense"
        c = self.chain_costs(self.order, 0, self.n_blocks, mode)
        reach = furthest_cover(c)
        need = float(self.need[mode][reach, self.n_blocks])
        return (f"needs {need / GiB:.1f} GiB more memory for blocks {_span(range(reach, self.n_blocks))} "
                "(no node left with room for them)")

    def _describe(self, d: Draft) -> str:
        nodes = _used(d)
        how = ", ".join(d.notes)
        mode = {"local": "experts with their stage", "spread": "experts spread over each stage's group",
                "dense": "dense", "kept": "the previous plan, repaired"}[d.mode]
        return f"{len(d.stages)} stages on {len(nodes)} of {len(self.nodes)} nodes, {mode}" + (f" ({how})" if how else "")

    def _to_plan(self, d: Draft, ev: Evaluation, epoch: int, reasons: list[str]) -> Plan:
        peers = [n.peer_id for n in self.nodes]
        stages = []
        for i, (node, a, b) in enumerate(d.stages):
            actors = (stage_actor(i), *(router_actor(x) for x in range(a, b) if self.layout.blocks[x].moe))
            stages.append(Stage(peers[node], (a, b), actors))
        ordered = order_holders(self.cm, d.stages, d.experts)
        experts = {
            blk: {x: tuple(peers[h] for h in hs) for x, hs in enumerate(holders)}
            for blk, holders in sorted(ordered.items())
        }
        stage_reasons = [
            f"{peers[node]} runs blocks {a}-{b - 1} ({ms:.3g} ms/token)" for (node, a, b), ms in zip(d.stages, ev.stage_ms, strict=True)
        ]
        if len(stage_reasons) > MAX_STAGE_REASONS:
            stage_reasons = [*stage_reasons[:MAX_STAGE_REASONS], f"... and {len(stage_reasons) - MAX_STAGE_REASONS} more stages"]
        reasons.extend(stage_reasons)
        used = _used(d)
        standbys, standby_reasons = choose_standbys(
            self.layout, self.nodes, [(peers[n], (a, b)) for n, a, b in d.stages], {peers[i] for i in used},
            self.opts, self.previous.standbys if self.previous else None)
        reasons.extend(standby_reasons)
        idle = [peers[i] for i in range(len(peers)) if i not in used and peers[i] not in standbys]
        if idle:
            reasons.append(f"{len(idle)} node(s) without an assignment: {', '.join(idle[:8])}"
                           + (" ..." if len(idle) > 8 else ""))
        reasons.append(f"predicted bottleneck: {ev.prediction.bottleneck}")
        fetch = self.fetch(d)
        if fetch.total_bytes:
            reasons.append(f"{len(fetch.bytes_by_node)} node(s) fetch {fetch.total_bytes / 2**20:.1f} MiB of weights "
                           f"first; ready in about {fetch.ready_s:.0f} s")
        return Plan(
            epoch=epoch,
            model=ModelRef(self.layout.name, self.layout.digest, self.layout.dtype),
            stages=tuple(stages),
            experts=experts,
            standbys=standbys,
            predicted=replace(ev.prediction, fetch_bytes=fetch.total_bytes, ready_s=round(fetch.ready_s, 3)),
            reasons=tuple(reasons),
            policy=self.policy,
        )


def _used(d: Draft) -> set[int]:
    return {n for n, _, _ in d.stages} | {h for hs in d.experts.values() for e in hs for h in e}


def _same_model(plan: Plan, layout: ModelLayout) -> bool:
    return plan.model.name == layout.name and plan.n_blocks == layout.n_blocks


def _key(score: tuple[float, float]) -> tuple[float, float]:
    """Scores compared at six significant digits, so float noise never decides between plans."""
    return (float(f"{score[0]:.6g}"), float(f"{score[1]:.6g}"))


def _span(blocks: Sequence[int] | range) -> str:
    blocks = list(blocks)
    if not blocks:
        return "(none)"
    return f"{blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else str(blocks[0])
