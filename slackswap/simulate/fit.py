"""Plan for what the allocator will reserve, not only for what the tensors need.

A plan that peaks a few hundred KB under its budget (byte-exact) can still run out of memory on a GPU,
where the caching allocator rounds, keeps unsplit slack and fragments. Two remedies, both optional:

- a margin: the planner sees `floor(budget x (1 - margin))`, the simulator and the allocator the full
  budget;
- planning against the reserved peak: plan, simulate, replay through the allocator model with the
  budget as capacity; while it runs out of memory, lower the planner's budget by the overshoot of the
  reserved peak over the budget (at least 1 % of the budget) and plan again, up to `max_rounds`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.memory.replay import AllocatorReport, allocator_report
from slackswap.plan import Plan
from slackswap.simulate.engine import simulate
from slackswap.simulate.result import SimResult


@dataclass(frozen=True)
class FittedPlan:
    plan: Plan
    result: SimResult
    #: None when the allocator is not modelled.
    report: AllocatorReport | None
    planning_budget_bytes: int
    rounds: int
    plan_wall_s: float
    sim_wall_s: float


def plan_and_simulate(
    planner,
    graph: Graph,
    hardware: Hardware,
    budget_bytes: int,
    *,
    allocator: bool = False,
    plan_against: str = "allocated",
    margin_fraction: float = 0.0,
    max_rounds: int = 8,
) -> FittedPlan:
    """Plan and simulate under `budget_bytes`. Raises the planner's `InfeasibleBudgetError`."""
    if plan_against not in ("allocated", "reserved"):
        raise ConfigError("plan_against", plan_against, "must be 'allocated' or 'reserved'")
    if plan_against == "reserved" and not allocator:
        raise ConfigError("plan_against", plan_against, "needs the allocator model")
    if not 0 <= margin_fraction < 1:
        raise ConfigError("margin_fraction", margin_fraction, "must be in [0, 1)")
    planning = math.floor(budget_bytes * (1 - margin_fraction))
    plan_wall = sim_wall = 0.0
    for rounds in range(1, max_rounds + 1):
        if planning <= 0:
            raise InfeasibleBudgetError(
                f"no planning budget left: the caching allocator's reserved peak still exceeds the budget of "
                f"{budget_bytes} bytes after {rounds - 1} round(s)"
            )
        t0 = time.perf_counter()
        plan = planner.plan(graph, hardware, planning)
        t1 = time.perf_counter()
        result = simulate(graph, plan, hardware, budget_bytes)
        report = allocator_report(graph, plan, result, budget_bytes) if allocator else None
        t2 = time.perf_counter()
        plan_wall += t1 - t0
        sim_wall += t2 - t1
        done = plan_against == "allocated" or not result.feasible or report.fits or rounds == max_rounds
        if done:
            return FittedPlan(plan, result, report, planning, rounds, plan_wall, sim_wall)
        planning -= max(report.peak_reserved_bytes - budget_bytes, budget_bytes // 100, 1)
    raise AssertionError("unreachable")
