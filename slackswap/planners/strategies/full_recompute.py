"""`full_recompute` (Chen et al. 2016, arXiv 1604.06174, "checkpoint every layer boundary").

Keep only the layer boundaries (the tensors a layer hands to the next, `analysis.boundary_tensors`)
and the activations outside the transformer stack (embedding, head, loss); drop every other saved
activation of every layer and regenerate it in backward from the layer's input checkpoint. The plan
does not depend on the budget: it either fits or the budget is infeasible for this strategy.
Chen et al. checkpoint every sqrt(n) *ops*; for a transformer the natural segment is the layer, as in
Megatron's "full" activation recompute (Korthikanti et al. 2022), which is what this models.
"""

from __future__ import annotations

from slackswap.graph import NO_LAYER, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import boundary_tensors
from slackswap.planners.support.fit import build_within_budget


def full_recompute_decisions(graph: Graph) -> dict[str, Decision]:
    boundary = boundary_tensors(graph)
    out = {}
    for t in graph.saved_tensors:
        in_stack = graph.op_by_name[t.producer].layer != NO_LAYER
        out[t.name] = Decision.RECOMPUTE if in_stack and t.name not in boundary else Decision.KEEP
    return out


@register_planner("full_recompute")
class FullRecompute:
    name = "full_recompute"

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        return build_within_budget(
            graph, full_recompute_decisions(graph), planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
            what="full recompute",
        )
