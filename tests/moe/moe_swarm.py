"""A swarm of real `swarmd join` processes serving a MoE model with its experts spread by the planner."""

from __future__ import annotations

from pathlib import Path

from planner import NodeDescriptor, PlanOptions, make_plan
from planner.plan import Plan
from tests.pipeline.daemon_swarm import DaemonSwarm

NODE_MEMORY = 8 << 30  # what the plan file assumes each daemon has


def spread_plan(model: str, peers: list[str], max_context: int) -> Plan:
    """The planner's own plan for these peers, experts spread over the daemons (as each daemon,
    started with --expert-placement spread, would re-plan them)."""
    from swarmd.model_source import served_model

    layout = served_model(model).layout
    nodes = [NodeDescriptor(p, NODE_MEMORY, NODE_MEMORY) for p in peers]
    options = PlanOptions(context_length=max_context, concurrency=4, expert_placement="spread")
    return make_plan(layout, nodes, epoch=1, options=options)


class MoESwarm(DaemonSwarm):
    def __init__(self, base: Path, bench_file: Path, n: int, model: str, *, max_context: int = 256) -> None:
        extra = ("--model", model, "--max-context", str(max_context), "--expert-placement", "spread")
        super().__init__(base, bench_file, n, extra=extra)
        self.plan = spread_plan(model, self.peers, max_context)
        self.plan_file.write_text(self.plan.dumps())

    def expert_nodes(self) -> set[str]:
        return {p for by in self.plan.experts.values() for peers in by.values() for p in peers}
