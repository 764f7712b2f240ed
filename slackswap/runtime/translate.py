"""Run a plan made on the torch profile's meta-traced graph: its decisions on the captured graph.

The traced graph (`slackswap.profile.torch`, docs/torch_profile.md) and the runtime's captured graph
name saved tensors with the same identities, so a plan's decisions carry over tensor by tensor. Its
*positions* do not: the traced graph folds views into their storage and keeps in-place calls as ops
of their own, the captured graph has one op per ATen call. The schedule is therefore rebuilt on the
captured graph by the scheduler every planner uses (`slackswap.schedule.build.build_schedule`: forward
in order, recompute chains right before their first backward reader, offload after the producer,
ALAP prefetch), which is how the planners turn decisions into steps in the first place.
"""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.runtime.executor import PlanMismatchError


def plan_on_captured(plan: Plan, traced: Graph, captured: Graph, hardware: Hardware) -> Plan:
    """`plan` (made on `traced`) with the same decisions, scheduled on `captured`. Named error on a mismatch."""
    from slackswap.schedule.build import build_schedule

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
    return build_schedule(captured, dict(plan.decisions), planner=plan.planner, budget_bytes=plan.budget_bytes,
                          hardware=hardware, notes={**dict(plan.notes), "scheduled_on": captured.name,
                                                    "decided_on": traced.name})
