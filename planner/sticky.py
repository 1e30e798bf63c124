"""The previous plan, repaired for the nodes that left: survivors keep everything they hold.

A lost stage whose exact block range a spare holds a copy of (`Plan.standbys`) goes to that spare:
nothing loads. Any other run of lost stages goes to the stage before it, the stage after it, both
(split at the best block), or one newcomer or spare without a stage, whichever fits in memory and
keeps the busiest of them least busy.
Experts whose every holder left go to the block's stage if it has room, else to the emptiest
node of the stage's group, else to the emptiest node anywhere.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from planner.cost import CostModel, Draft
from planner.layout import ModelLayout
from planner.node import NodeDescriptor
from planner.plan import Plan
from planner.topology import Topology

Stage3 = list[int]  # [node, start, end]


class PlanningRun(Protocol):
    """What a repair reads of one planning run (`planner.policies.Planner`): nodes by index, their room and costs."""

    layout: ModelLayout
    nodes: list[NodeDescriptor]
    index: dict[str, int]  # peer id -> node index
    order: list[int]  # ready nodes in the topology's order
    spares: list[int]  # standby nodes without a stage
    capacity: np.ndarray  # bytes each node can give the plan
    free: np.ndarray  # the same, 0 for spares
    need: dict[str, np.ndarray]  # "dense": bytes of blocks [a, b)
    n_blocks: int
    cm: CostModel
    topo: Topology


def repair(p: PlanningRun, previous: Plan) -> Draft | None:
    """The previous plan over the current nodes, or None when it cannot be repaired in memory."""
    def alive(peer: str) -> int | None:
        i = p.index.get(peer)
        return i if i is not None and p.free[i] > 0 else None

    layout, need = p.layout, p.need["dense"]
    moe_blocks = layout.moe_blocks()
    if set(previous.experts) != set(moe_blocks):
        return None
    experts: dict[int, list[list[int]]] = {}
    for blk in moe_blocks:
        by = previous.experts[blk]
        n_exp = layout.blocks[blk].moe.n_experts  # type: ignore[union-attr]
        if sorted(by) != list(range(n_exp)):
            return None
        experts[blk] = [[i for i in (alive(h) for h in by[x]) if i is not None] for x in range(n_exp)]

    # The spares' real room (the planner keeps them out of fresh plans with a free of 0).
    free = p.free.copy()
    free[p.spares] = p.capacity[p.spares]
    copies = {layers: p.index[peer] for peer, layers in sorted(previous.standbys.items())
              if peer in p.index and p.index[peer] in p.spares and free[p.index[peer]] > 0}
    kept, promoted = [], []
    for s in previous.stages:
        n = alive(s.peer_id)
        if n is None and s.layers in copies:
            n = copies.pop(s.layers)
            promoted.append(p.nodes[n].peer_id)
        kept.append((n, s.layers[0], s.layers[1]))
    survivors: list[Stage3] = [[n, a, b] for n, a, b in kept if n is not None]
    if not survivors:
        return None
    use = np.zeros(len(p.nodes))
    for n, a, b in survivors:
        use[n] += need[a, b]
    for blk, hs in experts.items():
        size = layout.blocks[blk].moe.bytes_per_expert  # type: ignore[union-attr]
        for h in hs:
            use[h] += size
    if np.any(use > free + 1e-6):
        return None
    previous_peers = set(previous.peers())
    taken = {n for n, _, _ in survivors}
    newcomers = [i for i in p.order if p.nodes[i].peer_id not in previous_peers]
    newcomers += [i for i in p.spares if i not in taken and free[i] > 0]

    stages = _fill_gaps(p, survivors, use, newcomers, free)
    if stages is None:
        return None
    for n, a, b in stages:
        if n not in taken:
            use[n] += need[a, b]
    if not _place_orphans(p, stages, experts, use):
        return None
    draft = Draft(stages=[(n, a, b) for n, a, b in stages],
                  experts={b: [tuple(h) for h in hs] for b, hs in experts.items()}, mode="kept")
    lost = len(previous.stages) - len(survivors) + len(promoted)
    draft.notes.append(f"{lost} lost stage(s) refilled" if lost else "no stage lost")
    if promoted:
        draft.notes.append(f"{len(promoted)} taken over by the standby holding a copy ({', '.join(promoted)})")
    return draft


def _fill_gaps(p: PlanningRun, survivors: list[Stage3], use: np.ndarray, newcomers: list[int],
               free: np.ndarray) -> list[Stage3] | None:
    need, nb = p.need["dense"], p.n_blocks
    out: list[Stage3] = []
    pos = 0  # first block not yet covered
    rest = [list(s) for s in survivors]
    while pos < nb:
        nxt = rest[0] if rest else None
        if nxt is not None and nxt[1] == pos:
            out.append(rest.pop(0))
            pos = out[-1][2]
            continue
        hi = nxt[1] if nxt is not None else nb
        choice = _best_fill(p, out[-1] if out else None, nxt, pos, hi, use, newcomers, free)
        if choice is None:
            return None
        kind, value = choice
        if kind == "split":
            if out:
                use[out[-1][0]] += need[out[-1][1], value] - need[out[-1][1], out[-1][2]]
                out[-1][2] = value
            if nxt is not None:
                use[nxt[0]] += need[value, nxt[2]] - need[nxt[1], nxt[2]]
                nxt[1] = value
        else:
            out.append([value, pos, hi])
            newcomers = [n for n in newcomers if n != value]
        pos = hi if kind == "new" else value
    return out


def _best_fill(p: PlanningRun, before: Stage3 | None, after: Stage3 | None, lo: int, hi: int,
               use: np.ndarray, newcomers: list[int], free: np.ndarray) -> tuple[str, int] | None:
    """The option for blocks [lo, hi) that fits and keeps the busiest involved node least busy."""
    need, ms = p.need["dense"], p.cm.block_ms
    head = p.cm.head_ms

    def busy(node: int, a: int, b: int) -> float:
        return float(ms[node, a:b].sum() + (head[node] if b == p.n_blocks else 0.0))

    def room(node: int) -> float:
        return float(free[node] - use[node])

    options: list[tuple[tuple[float, float], tuple[str, int]]] = []
    for k in range(lo, hi + 1):
        if (k > lo and before is None) or (k < hi and after is None):
            continue
        cost, ok = [], True
        if before is not None and k > lo:
            ok &= need[before[1], k] - need[before[1], before[2]] <= room(before[0]) + 1e-6
            cost.append(busy(before[0], before[1], k))
        if after is not None and k < hi:
            ok &= need[k, after[2]] - need[after[1], after[2]] <= room(after[0]) + 1e-6
            cost.append(busy(after[0], k, after[2]))
        if ok:
            options.append(((max(cost), sum(cost)), ("split", k)))
    for n in newcomers:
        if need[lo, hi] <= room(n) + 1e-6:
            c = busy(n, lo, hi)
            options.append(((c, c), ("new", n)))
    if not options:
        return None
    return min(options, key=lambda o: o[0])[1]


def _place_orphans(p: PlanningRun, stages: list[Stage3], experts: dict[int, list[list[int]]], use: np.ndarray) -> bool:
    stage_of = {blk: n for n, a, b in stages for blk in range(a, b)}
    topo = p.topo
    for blk, hs in experts.items():
        orphans = [x for x, h in enumerate(hs) if not h]
        if not orphans:
            continue
        size = p.layout.blocks[blk].moe.bytes_per_expert  # type: ignore[union-attr]
        s = stage_of[blk]
        group = topo.group_of[s]
        for x in orphans:
            room = p.free - use
            fits = np.flatnonzero(room >= size)
            if len(fits) == 0:
                return False
            # the stage itself, then its group by most room, then anywhere by most room
            best = min(fits, key=lambda n: (n != s, topo.group_of[n] != group, -room[n], n))
            hs[x] = [int(best)]
            use[best] += size
    return True
