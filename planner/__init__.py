"""Pure planning: (ModelLayout, [NodeDescriptor]) -> Plan. No I/O, no trio, no tinygrad."""

from planner.arch import BUILTIN_ARCHS, ArchSpec, default_dtype, layout_from_arch
from planner.check import check_plan_against
from planner.errors import InfeasiblePlan, PlanSchemaError
from planner.layout import BlockLayout, ModelLayout, MoESpec
from planner.node import NodeDescriptor
from planner.options import PlanOptions
from planner.plan import Plan, Stage
from planner.policies import POLICIES, make_plan

__all__ = [
    "BUILTIN_ARCHS",
    "POLICIES",
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
    "check_plan_against",
    "default_dtype",
    "layout_from_arch",
    "make_plan",
]
