"""Pure planning: (ModelLayout, [NodeDescriptor]) -> Plan. No I/O, no trio, no tinygrad."""

from planner.arch import BUILTIN_ARCHS, ArchSpec, layout_from_arch
from planner.errors import InfeasiblePlan, PlanSchemaError
from planner.layout import BlockLayout, ModelLayout, MoESpec
from planner.node import NodeDescriptor
from planner.options import PlanOptions
from planner.plan import Plan, Stage
from planner.policies import make_plan

__all__ = [
    "BUILTIN_ARCHS",
    "ArchSpec",
    "BlockLayout",
    "InfeasiblePlan",
    "MoESpec",
    "ModelLayout",
    "NodeDescriptor",
    "Plan",
    "PlanOptions",
    "PlanSchemaError",
    "Stage",
    "layout_from_arch",
    "make_plan",
]
