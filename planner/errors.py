"""Errors the planner raises for input it cannot plan."""


class InfeasiblePlan(ValueError):
    """The nodes cannot hold the model; the message says what is missing, in one line."""


class PlanSchemaError(ValueError):
    """A Plan, layout or descriptor document does not match its schema."""
