"""A plan made for the export to PyTorch: any planner's plan inside the space PyTorch's checkpointing
executes decision for decision (docs/runtime.md, "A plan made for the export").

Here, in the experiment layer, because it joins two layers below it: the facts of the export come
from the runtime (`slackswap.runtime.export_facts`, which reads ATen tags and needs torch), the
planning with tensors fixed to keep from the planners (`slackswap.planners.support.fixed_keep`, no
torch). torch is imported when the function runs, so importing this module needs no torch.
"""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.planners.base import Planner
from slackswap.planners.support.fixed_keep import plan_with_fixed_keep


def plan_for_export(planner: Planner, graph: Graph, model: object, hardware: Hardware,
                    budget_bytes: int | None) -> Plan:
    """`planner`'s plan of `graph` (captured by `slackswap.runtime.capture_graph` from `model`) with every
    tensor PyTorch keeps whatever a plan says kept, the tensors one policy decides together decided
    alike and no decision for a candidate nothing keeps, its peak within `budget_bytes`
    (`InfeasibleBudgetError` with the reason otherwise). `PlanExport(plan, graph, model)` then executes
    every decision as planned: eager, `step_differences()` is empty."""
    from slackswap.runtime.export_facts import export_facts, layer_paths

    facts = export_facts(graph, layer_paths(model))
    held = [t for t in facts.held_inputs if t in graph.candidate_names]
    return plan_with_fixed_keep(planner, graph, hardware, budget_bytes, facts.fixed_keep, facts.tied, facts.not_kept,
                                held)


__all__ = ["plan_for_export"]
