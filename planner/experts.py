"""Which nodes hold which routed experts.

Two layouts, both candidates for every MoE plan:

* local: each block's experts live on the node that runs the block. No fan-out on the network at
  all, but a stage needs memory for all its experts (9.5 GB per Kimi-K2 block at int4).
* spread: the stage keeps the block's dense part (and as many of its own experts as its share of
  memory allows); the rest go to the other nodes of the stage's low-latency group, in proportion
  to free memory (balanced) or filling the fewest, largest nodes first (min-latency). A group that
  cannot hold the experts of the blocks staged in it spills to the nearest groups, and only the
  group's last blocks spill.

Hot experts (from load statistics; uniform when unknown) get replicas in the same group while
spare memory allows. Each expert's holders are listed nearest to the block's stage first: that is
the order a router tries them in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.cost import CostModel, Holders
from planner.errors import InfeasiblePlan
from planner.options import GiB


def place_local(cm: CostModel, stages: Sequence[tuple[int, int, int]]) -> dict[int, Holders]:
    out: dict[int, Holders] = {}
    for node, a, b in stages:
        for blk in range(a, b):
            moe = cm.layout.blocks[blk].moe
            if moe is not None:
                out[blk] = [(node,)] * moe.n_experts
    return out


def place_spread(
    cm: CostModel, stages: Sequence[tuple[int, int, int]], spare: np.ndarray, policy: str
) -> dict[int, Holders]:
    """Spread every routed expert once over nodes near its block's stage; raise if they do not fit.

    `spare` is each node's memory left for experts (bytes), after its stage and overhead."""
    layout, topo = cm.layout, cm.topo
    stage_of = {blk: node for node, a, b in stages for blk in range(a, b)}
    moe_blocks = layout.moe_blocks()
    if not moe_blocks:
        return {}
    size = max(layout.blocks[b].moe.bytes_per_expert for b in moe_blocks)  # type: ignore[union-attr]
    slots_free = np.floor(np.maximum(spare, 0) / size).astype(np.int64)
    n_groups = len(topo.groups)
    blocks_of_group: list[list[int]] = [[] for _ in range(n_groups)]
    for blk in moe_blocks:
        blocks_of_group[int(topo.group_of[stage_of[blk]])].append(blk)
    demand = [sum(_experts(cm, b) for b in bs) for bs in blocks_of_group]
    stage_nodes = {node for node, _, _ in stages}

    # 1. Each group serves its own blocks from its own nodes first.
    slots: list[dict[int, int]] = [{} for _ in range(n_groups)]
    for g, members in enumerate(topo.groups):
        if demand[g]:
            take = _allocate(list(members), slots_free, demand[g], policy, stage_nodes)
            for node, count in take.items():
                slots[g][node] = count
                slots_free[node] -= count
    # 2. What a group cannot hold goes to the nearest groups' spare memory.
    gdist = topo.group_rtt
    for g in range(n_groups):
        short = demand[g] - sum(slots[g].values())
        for h in np.argsort(gdist[g], kind="stable"):
            if short <= 0:
                break
            if h == g:
                continue
            take = _allocate(list(topo.groups[h]), slots_free, short, policy, set())
            for node, count in take.items():
                slots[g][node] = slots[g].get(node, 0) + count
                slots_free[node] -= count
                short -= count
        if short > 0:
            # The group's last blocks are the ones left without room.
            unplaced, count = [], 0
            for b in reversed(blocks_of_group[g]):
                if count >= short:
                    break
                unplaced.append(b)
                count += _experts(cm, b)
            raise InfeasiblePlan(f"needs {short * size / GiB:.1f} GiB more memory for the experts of "
                                 f"blocks {_span(sorted(unplaced))}")

    # 3. Expert by expert: the stage keeps its own first, the rest interleaved over the group.
    out: dict[int, list[tuple[int, ...] | None]] = {
        b: [None] * _experts(cm, b) for b in moe_blocks
    }
    for g in range(n_groups):
        if not blocks_of_group[g]:
            continue
        left = dict(slots[g])
        for node in sorted(stage_nodes & set(left), key=lambda n: topo.rank[n]):
            own = [b for b in blocks_of_group[g] if stage_of[b] == node]
            _give_own(out, own, node, left)
        pairs = [(b, x) for b in blocks_of_group[g] for x, h in enumerate(out[b]) if h is None]
        home = [n for n in topo.groups[g] if left.get(n, 0) > 0]
        in_group = set(topo.groups[g])
        foreign = [n for n in left if left[n] > 0 and n not in in_group]
        foreign.sort(key=lambda n: (gdist[g, int(topo.group_of[n])], topo.rank[n]))
        if policy == "balanced":
            sequence = _interleave(home, left) + [n for n in foreign for _ in range(left[n])]
        else:
            sequence = [n for n in home + foreign for _ in range(left[n])]
        for (b, x), node in zip(pairs, sequence, strict=False):
            out[b][x] = (node,)
    placed: dict[int, Holders] = {}
    for b, hs in out.items():
        assert all(h is not None for h in hs)
        placed[b] = [h for h in hs if h is not None]
    return placed


def replicate_hot(
    cm: CostModel, stages: Sequence[tuple[int, int, int]], experts: dict[int, Holders], spare: np.ndarray
) -> tuple[dict[int, Holders], int]:
    """Copies of hot experts (load >= hot_expert_factor x mean) inside the stage's group, while a
    node's replica budget (a fraction of its spare memory) lasts. Returns (experts, copies made)."""
    opts, topo = cm.opts, cm.topo
    stage_of = {blk: node for node, a, b in stages for blk in range(a, b)}
    budget = np.maximum(spare, 0) * opts.replica_memory_fraction
    made = 0
    out = {b: list(hs) for b, hs in experts.items()}
    for blk in sorted(out):
        moe = cm.layout.blocks[blk].moe
        assert moe is not None
        load = opts.load_of(blk, moe.n_experts)
        if load is None:
            continue
        stage = stage_of[blk]
        group = np.asarray(topo.groups[int(topo.group_of[stage])])
        for x in sorted(range(moe.n_experts), key=lambda x: (-load[x], x)):
            if load[x] < opts.hot_expert_factor:
                break
            copies = min(opts.max_replicas, 1 + int(load[x] // opts.hot_expert_factor))
            holders = list(out[blk][x])
            candidates = sorted((n for n in group if n not in holders),
                                key=lambda n: (n != stage, cm.topo.rtt[stage, n], -budget[n], n))
            for n in candidates:
                if len(holders) >= copies:
                    break
                if budget[n] >= moe.bytes_per_expert:
                    budget[n] -= moe.bytes_per_expert
                    holders.append(int(n))
                    made += 1
            out[blk][x] = tuple(holders)
    return order_holders(cm, stages, out), made


def order_holders(cm: CostModel, stages: Sequence[tuple[int, int, int]], experts: dict[int, Holders]) -> dict[int, Holders]:
    """Each expert's holders nearest to the block's stage first (ties: the stage, then index)."""
    stage_of = {blk: node for node, a, b in stages for blk in range(a, b)}
    rtt = cm.topo.rtt
    out = {}
    for blk, hs in experts.items():
        s = stage_of[blk]
        out[blk] = [h if len(h) == 1 else tuple(sorted(h, key=lambda n: (rtt[s, n], n != s, n))) for h in hs]
    return out


def _experts(cm: CostModel, blk: int) -> int:
    moe = cm.layout.blocks[blk].moe
    return moe.n_experts if moe else 0


def _allocate(members: list[int], free: np.ndarray, demand: int, policy: str, first: set[int]) -> dict[int, int]:
    """How many expert slots each member gives, at most `demand` in all.

    balanced: one each while there are enough experts (nodes without a stage first), the rest in
    proportion to free slots;
    min-latency: stage nodes first, then the members with the most room."""
    avail = {n: int(free[n]) for n in members if free[n] > 0}
    total = sum(avail.values())
    if total <= demand:
        return avail
    if policy == "balanced":
        nodes = sorted(avail)
        # One expert each first, nodes without a stage before stage nodes, most room first.
        firsts = sorted(nodes, key=lambda n: (n in first, -avail[n], n))[:demand]
        base = dict.fromkeys(firsts, 1)
        rest = demand - sum(base.values())
        room = np.array([avail[n] - base.get(n, 0) for n in nodes], dtype=float)
        share = room / room.sum() * rest if room.sum() > 0 else np.zeros(len(nodes))
        whole = np.minimum(np.floor(share).astype(np.int64), room.astype(np.int64))
        left = rest - int(whole.sum())
        frac = share - whole
        for i in np.argsort(-frac, kind="stable"):
            if left <= 0:
                break
            if whole[i] < room[i]:
                whole[i] += 1
                left -= 1
        return {n: base.get(n, 0) + int(w) for n, w in zip(nodes, whole, strict=True) if base.get(n, 0) + w > 0}
    out: dict[int, int] = {}
    for n in sorted(avail, key=lambda n: (n not in first, -avail[n], n)):
        if demand <= 0:
            break
        take = min(avail[n], demand)
        out[n] = take
        demand -= take
    return out


def _give_own(out: dict[int, list], own: list[int], node: int, left: dict[int, int]) -> None:
    """The stage node takes experts of its own blocks, round robin over them, lowest index first."""
    cursor = dict.fromkeys(own, 0)
    while left.get(node, 0) > 0 and cursor:
        for b in list(cursor):
            if left[node] <= 0:
                break
            x = cursor[b]
            if x >= len(out[b]):
                del cursor[b]
                continue
            out[b][x] = (node,)
            cursor[b] = x + 1
            left[node] -= 1


def _interleave(nodes: list[int], count: dict[int, int]) -> list[int]:
    """Each node repeated count[n] times, spread evenly through the sequence (Webster positions),
    so that consecutive experts of one block land on different nodes."""
    if not nodes:
        return []
    owner = np.concatenate([np.full(count[n], i) for i, n in enumerate(nodes)])
    position = np.concatenate([(np.arange(count[n]) + 0.5) / count[n] for n in nodes])
    seq = np.lexsort((owner, position))
    return [nodes[int(owner[i])] for i in seq]


def _span(blocks: Sequence[int]) -> str:
    return f"{blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else str(blocks[0])
