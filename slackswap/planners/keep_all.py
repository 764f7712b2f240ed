"""`keep_all`: keep every activation on the device, no limit. Its simulated step is the ideal."""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.plan import ComputeStep, Decision, Plan, StepKind


def keep_all_plan(graph: Graph, budget_bytes: int | None = None) -> Plan:
    return Plan(
        planner="keep_all",
        budget_bytes=budget_bytes,
        decisions={t.name: Decision.KEEP for t in graph.saved_tensors},
        steps=tuple(ComputeStep(op.name, StepKind.RUN, op.outputs) for op in graph.ops),
    )
