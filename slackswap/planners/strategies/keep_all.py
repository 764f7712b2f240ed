"""`keep_all`: keep every activation on the device, no limit. Its simulated step is the ideal.

As a planner under a budget it only succeeds if the keep-all peak fits; otherwise it says by how much
it does not (it never returns a plan it knows breaks the budget).
"""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.support.budget_check import build_within_budget


@register_planner("keep_all")
class KeepAll:
    """Keep everything; the ideal step. Infeasible under any budget below the keep-all peak."""

    name = "keep_all"

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        keep = dict.fromkeys((t.name for t in graph.saved_tensors), Decision.KEEP)
        return build_within_budget(
            graph, keep, planner=self.name, budget_bytes=budget_bytes, hardware=hardware, what="keeping everything"
        )
