"""A plan made for the export to PyTorch: any planner's plan inside the space PyTorch's checkpointing
executes decision for decision, priced at the bytes the executor that runs it stores (docs/runtime.md,
"A plan made for the export").

Here, in the experiment layer, because it joins two layers below it: the facts of the export and the
graph as each executor stores it come from the runtime (`slackswap.runtime.export_facts`,
`slackswap.runtime.export_graph`, which read ATen tags and kernels and need torch), the planning with
tensors fixed to keep from the planners (`slackswap.planners.support.fixed_keep`, no torch). torch is
imported when the function runs, so importing this module needs no torch.
"""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.planners.base import Planner
from slackswap.planners.support.fixed_keep import plan_with_fixed_keep


def export_plan_graph(graph: Graph, model: object, compile: bool = False) -> Graph:
    """The graph `plan_for_export(..., compile=compile)` plans on: compiled, each dropout's mask inside a
    layer at its compiled bytes (`slackswap.runtime.export_graph.graph_for_compile`); eager, `graph`. The
    simulator run on it prices that plan as the executor stores it."""
    from slackswap.runtime.export_facts import layer_paths
    from slackswap.runtime.export_graph import export_graph

    return export_graph(graph, layer_paths(model), compile)


def plan_for_export(planner: Planner, graph: Graph, model: object, hardware: Hardware,
                    budget_bytes: int | None, compile: bool = False) -> Plan:
    """`planner`'s plan of `graph` (captured by `slackswap.runtime.capture_graph` from `model`) with every
    tensor PyTorch keeps whatever a plan says kept, the tensors one policy decides together decided
    alike and no decision for a candidate nothing keeps, its peak within `budget_bytes`
    (`InfeasibleBudgetError` with the reason otherwise), every tensor at the bytes the export's executor
    stores: `compile`, the compiled step's (`export_plan_graph`), else CPU eager's. `PlanExport(plan,
    graph, model)` then executes every decision as planned (eager: `step_differences()` is empty;
    compiled, with `compile`: the partition saves the planned bytes). The plan's notes say which
    executor it was made for (`export_executor`), and `PlanExport` checks against that graph."""
    from slackswap.runtime.export_facts import export_facts, layer_paths
    from slackswap.runtime.export_graph import priced_for

    graph = export_plan_graph(graph, model, compile)
    facts = export_facts(graph, layer_paths(model))
    held = [t for t in facts.held_inputs if t in graph.candidate_names]
    plan = plan_with_fixed_keep(planner, graph, hardware, budget_bytes, facts.fixed_keep, facts.tied,
                                facts.not_kept, held, cached_together=facts.cached_together)
    return priced_for(plan, compile)


__all__ = ["export_plan_graph", "plan_for_export"]
