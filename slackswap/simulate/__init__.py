"""Simulate stage: execute an explicit plan in time under an activation memory budget.

`simulate(graph, plan, hardware, budget_bytes)` validates the plan, runs it, and returns a
`SimResult`. Semantics: docs/simulation.md. Writers for trace.json / timeline.png and the metrics
dict live in `trace`, `timeline` and `metrics` (timeline imports matplotlib lazily).
"""

from slackswap.schedule.validate import resolve_schedule, validate_plan
from slackswap.simulate.engine import simulate
from slackswap.simulate.result import Infeasibility, SimResult, TraceEvent

__all__ = [
    "Infeasibility",
    "SimResult",
    "TraceEvent",
    "resolve_schedule",
    "simulate",
    "validate_plan",
]
