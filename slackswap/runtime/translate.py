"""Run a plan made on the torch profile's meta-traced graph: its decisions on the captured graph.

The traced graph (`slackswap.profile.torch`, docs/torch_profile.md) and the runtime's captured graph
name saved tensors with the same identities, so a plan's decisions carry over tensor by tensor. Its
*positions* do not: the traced graph folds views into their storage and keeps in-place calls as ops
of their own, the captured graph has one op per ATen call. The schedule is therefore rebuilt on the
captured graph by the scheduler every planner uses (`slackswap.schedule.build.build_schedule`: forward
in order, recompute chains right before their first backward reader, offload after the producer,
ALAP prefetch), which is how the planners turn decisions into steps in the first place.

Both graphs count the same bytes as activations (docs/memory.md: a weight gradient is model state in
both; the captured graph used to count every one, held from the backward op that makes it to the
step's end, and translated plans overran their budget by up to 160 % on 2-layer shapes). Keep-all,
the two graphs now peak at the same byte. The same decisions can still cost other bytes at the
captured graph's finer positions (a prefetch placed on other ops), so a plan moved across is
re-checked against its budget on the captured graph: the replayed peak
(`slackswap.schedule.replay.estimate_plan`, which the simulator agrees with) must fit. Over it, the
plan is made again on the captured graph when a planner is given, else refused
(`InfeasibleBudgetError` naming both peaks and the overrun in bytes).
"""

from __future__ import annotations

from dataclasses import replace

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.runtime.errors import PlanMismatchError


def plan_on_captured(plan: Plan, traced: Graph, captured: Graph, hardware: Hardware,
                     planner: object | None = None) -> Plan:
    """`plan` (made on `traced`) with the same decisions, scheduled on `captured`, its replayed peak there
    within `plan.budget_bytes`. Over the budget: `planner`'s own plan of `captured` at that budget (its
    notes say why; any object with `plan(graph, hardware, budget_bytes)`, a planner of the registry:
    the runtime sits below the planners), or without a planner `InfeasibleBudgetError` naming both
    peaks and the overrun in bytes. Named error on a mismatch of the saved tensors' names (their bytes
    may differ: a plan of another shape is over its budget, or not, by the bytes of this run).

    The check is the replay's peak, which no plan waits for memory in; a plan that relies on waiting
    (`swap_only` with `memory_waits`) can be refused here though the simulator would run it within
    its budget by waiting."""
    from slackswap.schedule.build import build_schedule
    from slackswap.schedule.replay import estimate_plan

    run_saved = {t.name for t in captured.saved_tensors}
    unknown = sorted(set(plan.decisions) - run_saved)
    if unknown:
        raise PlanMismatchError(
            f"plan of graph {traced.name!r} decides {len(unknown)} tensor(s) this run does not save, e.g. "
            f"{unknown[:3]}: another model, other shapes, other kernels (trace with the run's semantics)"
        )
    undecided = sorted(run_saved - set(plan.decisions))
    if undecided:
        raise PlanMismatchError(
            f"this run saves {len(undecided)} tensor(s) the plan of graph {traced.name!r} does not decide, "
            f"e.g. {undecided[:3]}: never kept silently; trace with the run's semantics and plan again"
        )
    moved = build_schedule(captured, dict(plan.decisions), planner=plan.planner, budget_bytes=plan.budget_bytes,
                           hardware=hardware, notes={**dict(plan.notes), "scheduled_on": captured.name,
                                                     "decided_on": traced.name})
    budget = plan.budget_bytes
    if budget is None:
        return moved
    peak = estimate_plan(captured, moved, hardware).peak_bytes
    if peak <= budget:
        return moved
    made = estimate_plan(traced, plan, hardware).peak_bytes
    why = (f"plan {plan.planner!r} of graph {traced.name!r} peaks at {peak} B on the captured graph "
           f"{captured.name!r} ({made} B where it was made), over its budget {budget} B by {peak - budget} B "
           f"({100 * (peak - budget) / budget:.2f} %): the captured graph runs the decisions at its own "
           "positions (one op per ATen call) on the run's own tensor bytes")
    if planner is None:
        raise InfeasibleBudgetError(f"{why}; plan again on the captured graph (plan_on_captured(..., planner=...))")
    replanned = planner.plan(captured, hardware, budget)  # InfeasibleBudgetError: refused, with the planner's reason
    return replace(replanned, notes={**dict(replanned.notes), "replanned_on": captured.name, "decided_on": traced.name,
                                     "translated_peak_bytes": peak})
