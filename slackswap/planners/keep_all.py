"""`keep_all`: keep every activation on the device, no limit. Its simulated step is the ideal.

As a planner under a budget it only succeeds if the keep-all peak fits; otherwise it says by how much
it does not (it never returns a plan it knows breaks the budget).
"""

from __future__ import annotations

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import ComputeStep, Decision, Plan, StepKind
from slackswap.planners.base import check_budget, gib
from slackswap.planners.registry import register_planner


def keep_all_plan(graph: Graph, budget_bytes: int | None = None) -> Plan:
    return Plan(
        planner="keep_all",
        budget_bytes=budget_bytes,
        decisions={t.name: Decision.KEEP for t in graph.saved_tensors},
        steps=tuple(ComputeStep(op.name, StepKind.RUN, op.outputs) for op in graph.ops),
    )


@register_planner("keep_all")
class KeepAll:
    """Keep everything; the ideal step. Infeasible under any budget below the keep-all peak."""

    name = "keep_all"

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        from slackswap.planners.timeline import estimate_plan

        check_budget(budget_bytes)
        plan = keep_all_plan(graph, budget_bytes)
        if budget_bytes is not None:
            peak = estimate_plan(graph, plan, hardware).peak_bytes
            if peak > budget_bytes:
                raise InfeasibleBudgetError(
                    f"keep_all needs the full keep-all peak {gib(peak)}, above the budget {gib(budget_bytes)}",
                    min_feasible_bytes=peak,
                )
        return plan
