"""The tail every planner shares: build the schedule for some decisions, replay it, and either hand
it over (its peak fits the budget) or raise `InfeasibleBudgetError` saying by how much it does not.

A planner never returns a plan whose replayed peak is above its budget; the replay agrees exactly
with the simulator on such plans (slackswap.schedule.replay), so a returned plan never waits for
memory in the simulator. (`swap_only` with `memory_waits: true` is the deliberate exception: it
reproduces vDNN's waits and checks its plan in the simulator, docs/planners.md.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import gib
from slackswap.schedule.build import build_schedule
from slackswap.schedule.replay import estimate_plan


def scheduled_peak(
    graph: Graph,
    decisions: Mapping[str, Decision],
    *,
    planner: str,
    budget_bytes: int | None,
    hardware: Hardware,
    **options: object,
) -> tuple[Plan, int]:
    """`build_schedule(...)` and the replayed activation peak of the plan it builds."""
    plan = build_schedule(graph, decisions, planner=planner, budget_bytes=budget_bytes, hardware=hardware, **options)
    return plan, estimate_plan(graph, plan, hardware).peak_bytes


def over_budget(planner: str, budget_bytes: int, what: str, detail: str = "") -> InfeasibleBudgetError:
    """The error for "the most frugal plan this strategy has (`what`) still peaks above the budget".

    It names no floor: the peak of the last candidate tried is not the least the planner reaches at
    another budget (docs/planners.md, "Floors"); the experiment layer finds that by bisection.
    """
    return InfeasibleBudgetError(f"{planner}: budget {gib(budget_bytes)}: {what} still peaks above it{detail}")


def build_within_budget(
    graph: Graph,
    decisions: Mapping[str, Decision],
    *,
    planner: str,
    budget_bytes: int | None,
    hardware: Hardware,
    what: str,
    **options: object,
) -> Plan:
    """Build, check the peak, raise infeasible: the plan for `decisions` if it fits, else `over_budget`."""
    plan, peak = scheduled_peak(
        graph, decisions, planner=planner, budget_bytes=budget_bytes, hardware=hardware, **options
    )
    if budget_bytes is not None and peak > budget_bytes:
        raise over_budget(planner, budget_bytes, what)
    return plan


def lower_until_within(
    graph: Graph, hardware: Hardware, budget_bytes: int, max_rounds: int, plan_at: Callable[[int, int], Plan],
) -> tuple[Plan, int, int]:
    """Plan with `plan_at(round_, inner_budget_bytes)`, replay the plan's peak, and while it is above
    `budget_bytes` plan again with the inner budget lowered by the excess: at most `max_rounds` more
    times, and while the inner budget stays positive. Why: a planner whose own memory model is coarser
    than the replay (DTR's eviction order, a plan mapped back from a derived graph) converges on the
    replay's peak this way. Returns (the last plan, its replayed peak, the rounds run); the caller
    hands the plan over if the peak fits, else raises its own `InfeasibleBudgetError`."""
    inner = budget_bytes
    for round_ in range(max_rounds + 1):
        plan = plan_at(round_, inner)
        peak = estimate_plan(graph, plan, hardware).peak_bytes
        excess = peak - budget_bytes
        if excess <= 0 or inner - excess <= 0 or round_ == max_rounds:
            return plan, peak, round_ + 1
        inner -= excess
    raise AssertionError("unreachable: the last round returns")
