"""Check an adopted Plan (say, `swarmd join --plan FILE`) against the members that are live now."""

from __future__ import annotations

from collections.abc import Sequence

from planner.errors import PlanSchemaError
from planner.layout import ModelLayout
from planner.memory import node_memory_use
from planner.node import NodeDescriptor
from planner.options import GiB, PlanOptions
from planner.plan import Plan, validate_chain


def check_plan_against(
    plan: Plan, layout: ModelLayout, nodes: Sequence[NodeDescriptor], options: PlanOptions | None = None
) -> list[str]:
    """Problems that stop `plan` from running on `nodes`, one line each; [] when it can run.

    Missing peers are reported as "peer X (stage 2) has not joined", so a caller waiting for
    members can tell those apart (`missing_peers`) from problems that waiting will not fix."""
    opts = options or PlanOptions()
    problems: list[str] = []
    if plan.model.name != layout.name:
        problems.append(f"the plan is for model {plan.model.name}, the swarm serves {layout.name}")
    elif plan.model.digest and layout.digest and plan.model.digest != layout.digest:
        problems.append(f"the plan is for other weights of {layout.name} (digest {plan.model.digest[:12]}, "
                        f"the swarm serves {layout.digest[:12]})")
    if plan.model.dtype and layout.dtype and plan.model.dtype != layout.dtype:
        problems.append(f"the plan is for {plan.model.dtype} weights, the model is {layout.dtype}")
    try:
        validate_chain(plan, layout.n_blocks)
    except PlanSchemaError as e:
        problems.append(str(e))
    moe_blocks = set(layout.moe_blocks())
    for b in sorted(set(plan.experts) - moe_blocks):
        problems.append(f"block {b} has no routed experts but the plan assigns some")
    for b in sorted(moe_blocks - set(plan.experts)):
        problems.append(f"MoE block {b} has no expert assignment")
    for b in sorted(moe_blocks & set(plan.experts)):
        n_exp = layout.blocks[b].moe.n_experts  # type: ignore[union-attr]
        by = plan.experts[b]
        orphans = [x for x in range(n_exp) if not by.get(x)]
        extra = sorted(x for x in by if not 0 <= x < n_exp)
        if orphans:
            problems.append(f"block {b}: {len(orphans)} expert(s) without a holder ({_few(orphans)})")
        if extra:
            problems.append(f"block {b}: experts {_few(extra)} do not exist (the block has {n_exp})")
    live = {n.peer_id: n for n in nodes}
    roles = {s.peer_id: f"stage {i}" for i, s in enumerate(plan.stages)}
    for peer in plan.peers():
        if peer not in live:
            problems.append(f"peer {peer} ({roles.get(peer, 'experts')}) has not joined")
    if problems and any(not p.startswith("peer ") for p in problems):
        return problems
    valid_experts = {b: by for b, by in plan.experts.items() if b in moe_blocks}
    use = node_memory_use(layout, [(s.peer_id, s.layers) for s in plan.stages], valid_experts, opts)
    for peer, need in sorted(use.items()):
        node = live.get(peer)
        if node is not None and need > node.memory_free:
            problems.append(f"peer {peer} needs {need / GiB:.1f} GiB for its assignment, "
                            f"has {node.memory_free / GiB:.1f} GiB free")
    return problems


def missing_peers(problems: Sequence[str]) -> bool:
    """True when every problem is a peer that has not joined yet (waiting can fix it)."""
    return bool(problems) and all(p.startswith("peer ") and p.endswith("has not joined") for p in problems)


def _few(xs: Sequence[int], n: int = 6) -> str:
    shown = ", ".join(str(x) for x in xs[:n])
    return shown + (f", ... ({len(xs)} in all)" if len(xs) > n else "")
