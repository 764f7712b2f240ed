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

from dataclasses import replace

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.planners.base import Planner, gib
from slackswap.planners.support.fixed_keep import plan_with_fixed_keep


def export_plan_graph(graph: Graph, model: object, compile: bool = False) -> Graph:
    """The graph `plan_for_export(..., compile=compile)` plans on: compiled, each dropout's mask inside a
    layer at its compiled bytes (`slackswap.runtime.export_graph.graph_for_compile`); eager, `graph`. The
    simulator run on it prices that plan as the executor stores it."""
    from slackswap.runtime.export_facts import layer_paths
    from slackswap.runtime.export_graph import export_graph

    return export_graph(graph, layer_paths(model), compile)


def plan_for_export(planner: Planner, graph: Graph, model: object, hardware: Hardware,
                    budget_bytes: int | None, compile: bool = False, fit_pytorch_placement: bool = True) -> Plan:
    """`planner`'s plan of `graph` (captured by `slackswap.runtime.capture_graph` from `model`) with every
    tensor PyTorch keeps whatever a plan says kept, the tensors one policy decides together decided
    alike and no decision for a candidate nothing keeps, its peak within `budget_bytes`
    and, unless `fit_pytorch_placement` is false, its peak as PyTorch places the decisions
    (`within_pytorchs_peak`) too (`InfeasibleBudgetError` with the reason otherwise), every tensor at
    the bytes the export's executor stores: `compile`, the compiled step's (`export_plan_graph`), else
    CPU eager's. `PlanExport(plan, graph, model)` then executes every decision as planned (eager:
    `step_differences()` is empty; compiled, with `compile`: the partition saves the planned bytes).
    The plan's notes say which executor it was made for (`export_executor`), and `PlanExport` checks
    against that graph."""
    from slackswap.runtime.export_facts import export_facts, layer_paths
    from slackswap.runtime.export_graph import priced_for

    graph = export_plan_graph(graph, model, compile)
    facts = export_facts(graph, layer_paths(model))
    held = [t for t in facts.held_inputs if t in graph.candidate_names]

    def plan_at(inner_budget: int | None) -> Plan:
        return plan_with_fixed_keep(planner, graph, hardware, inner_budget, facts.fixed_keep, facts.tied,
                                    facts.not_kept, held, cached_together=facts.cached_together)

    if not fit_pytorch_placement:  # the plan within its own replay only (a benchmark timing a fixed budget)
        return priced_for(plan_at(budget_bytes), compile)
    priced = pytorch_graph(graph, facts, compile)
    mode = "compiled" if compile else "eager"
    try:
        plan = within_pytorchs_peak(priced, hardware, budget_bytes, mode, plan_at, planner.name)
    except InfeasibleBudgetError as exc:
        recompute_all = recompute_all_peak_bytes(graph, priced, facts, hardware, mode, held)
        raise InfeasibleBudgetError(f"{planner.name}: budget {budget_bytes} B; "
                                    f"{what_pytorch_keeps(graph, facts, held, recompute_all, mode)}: {exc.reason}"
                                    ) from None
    return priced_for(plan, compile)


class _RecomputeEvery:
    """Every saved tensor a plan may decide recomputed."""

    name = "recompute_every_decidable"

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        from slackswap.plan import Decision
        from slackswap.schedule.build import build_schedule

        decisions = {t.name: Decision.RECOMPUTE for t in graph.saved_tensors}
        return build_schedule(graph, decisions, planner=self.name, budget_bytes=None, hardware=hardware)


def recompute_all_peak_bytes(graph: Graph, priced: Graph, facts: object, hardware: Hardware, mode: str,
                             held: list[str]) -> int:
    """The peak, as PyTorch runs it (`mode`, priced on `priced`), of the plan that keeps only what PyTorch
    keeps whatever a plan says (`facts`: `ExportFacts`) and recomputes every other tensor. Not a floor:
    a plan that swaps, or keeps what a recompute would run a large transient again for (the attention
    scores), can peak lower as PyTorch places it (GPT-NeoX at 70 %: slackswap's 1.116 MiB, this 1.194)."""
    plan = plan_with_fixed_keep(_RecomputeEvery(), graph, hardware, None, facts.fixed_keep, facts.tied,
                                facts.not_kept, held, cached_together=facts.cached_together)
    return pytorch_peak_bytes(priced, plan, hardware, mode)


def what_pytorch_keeps(graph: Graph, facts: object, held: list[str], recompute_all_bytes: int, mode: str) -> str:
    """What an infeasible budget for the export meets whatever the planner: the bytes PyTorch keeps whatever a
    plan says, by reason, the unsaved layer inputs its checkpoints hold, and `recompute_all_peak_bytes`."""
    by_reason: dict[str, int] = {}
    for name, why in facts.fixed_keep.items():
        short = why.split(":")[0].split(" (")[0]
        by_reason[short] = by_reason.get(short, 0) + graph.tensors[name].size_bytes
    kept = "; ".join(f"{b} B {why}" for why, b in sorted(by_reason.items(), key=lambda kv: -kv[1]))
    held_bytes = sum(graph.tensors[t].size_bytes for t in held)
    return (f"PyTorch keeps {sum(by_reason.values())} B whatever a plan says ({kept}), its checkpoints hold "
            f"{held_bytes} B of unsaved layer inputs, and recomputing every other tensor peaks at "
            f"{recompute_all_bytes} B as its {mode} checkpointing runs it")


def pytorch_graph(graph: Graph, facts: object, compile: bool) -> Graph:
    """The graph PyTorch's execution of a plan for the export is priced on: eager, with the holds of the
    checkpoint frames (`slackswap.pytorch_execution.eager_frame_holds`: the unsaved layer inputs a
    frame keeps as arguments and the layer outputs its cache keeps, until the frame dies); compiled,
    `graph` (the partition keeps no frame). `facts`: `slackswap.runtime.export_facts.ExportFacts`."""
    if compile:
        return graph
    from slackswap.pytorch_execution import eager_frame_holds
    from slackswap.runtime.export_facts import LAYER_OUTPUT

    outputs = [t for t, why in facts.fixed_keep.items() if why == LAYER_OUTPUT]
    return eager_frame_holds(graph, list(facts.held_inputs), outputs)


def pytorch_peak_bytes(graph: Graph, plan: Plan, hardware: Hardware, mode: str) -> int:
    """The replayed activation peak of `plan` as PyTorch places its decisions (`mode` "eager": each
    layer's recomputes in one block before its first backward reader, reloads there; "compiled": the
    partitioner's placement), `slackswap.pytorch_execution.pytorch_plan`. `graph` may be the plan's
    graph with other holds (`pytorch_graph`): the plan is priced on it as made for it."""
    from slackswap.pytorch_execution import eager_cache_holds, eager_replay_peak_bytes, pytorch_plan
    from slackswap.schedule.replay import estimate_plan

    if mode == "eager":
        graph = eager_cache_holds(graph, plan.decisions)
    plan = replace(plan, graph_fingerprint=graph.fingerprint)
    executed = pytorch_plan(graph, plan, dict(plan.decisions), hardware, mode)
    if mode == "eager":
        return eager_replay_peak_bytes(graph, executed, hardware)
    return estimate_plan(graph, executed, hardware).peak_bytes


def within_pytorchs_peak(graph: Graph, hardware: Hardware, budget_bytes: int | None, mode: str,
                         plan_at, planner_name: str, max_rounds: int = 4) -> Plan:
    """`plan_at(inner_budget)`'s plan whose peak as PyTorch executes it fits `budget_bytes`: PyTorch
    recomputes a layer's tensors all at once, before its first backward reader, where the plan's own
    schedule recomputes each right before its reader, so a plan within its budget can run over it.
    Over it, planned again with the inner budget lowered by the excess (at most `max_rounds` times);
    still over: `InfeasibleBudgetError` naming both peaks. Refused before the step runs, not after."""
    plan = plan_at(budget_bytes)
    if budget_bytes is None:
        return plan
    inner = budget_bytes
    for round_ in range(max_rounds + 1):
        peak = pytorch_peak_bytes(graph, plan, hardware, mode)
        excess = peak - budget_bytes
        if excess <= 0:
            return replace(plan, notes={**dict(plan.notes), "pytorch_peak_bytes": peak,
                                        "pytorch_peak_rounds": round_})
        if round_ == max_rounds or inner - excess <= 0:
            break
        inner -= excess
        try:
            plan = plan_at(inner)
        except InfeasibleBudgetError as exc:
            raise InfeasibleBudgetError(
                f"{planner_name}: its plan within {gib(budget_bytes)} peaks at {gib(peak)} as PyTorch's {mode} "
                f"checkpointing runs it (a layer's recomputes at once); planned again at {gib(inner)}: {exc}") from None
    raise InfeasibleBudgetError(
        f"{planner_name}: the plan made for the export peaks at {gib(peak)} ({peak} B) as PyTorch's {mode} "
        f"checkpointing runs it (a layer's recomputes at once, before its first backward reader), over the budget "
        f"{gib(budget_bytes)} ({budget_bytes} B) after {round_ + 1} round(s) of planning lower")


__all__ = ["export_plan_graph", "plan_for_export", "pytorch_graph", "pytorch_peak_bytes", "recompute_all_peak_bytes",
           "what_pytorch_keeps", "within_pytorchs_peak"]
