"""Plan for what the allocator will reserve, not only for what the tensors need.

A plan that peaks a few hundred KB under its budget (byte-exact) can still run out of memory on a GPU,
where the caching allocator rounds, keeps unsplit slack and fragments. Two remedies, both optional
(`FitOptions`, the `simulate` config node):

- a margin: the planner sees `floor(budget x (1 - margin))`, the simulator and the allocator the full
  budget;
- planning against the reserved peak: plan, simulate, replay through the allocator model with the
  budget as capacity; while it runs out of memory, lower the planner's budget by the overshoot of the
  reserved peak over the budget (at least 1 % of the budget) and plan again, up to `max_rounds`.

This loop calls the planner, the simulator and the allocator replay, so it lives above all three
(the experiment layer, docs/architecture.md): neither `simulate` nor `memory` imports the other.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slackswap import validation as check
from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.memory.allocator_replay import AllocatorReport, allocator_report
from slackswap.plan import Plan
from slackswap.simulate.engine import simulate
from slackswap.simulate.result import SimResult

ALLOCATORS: tuple[str, ...] = ("none", "caching")
PLAN_AGAINST: tuple[str, ...] = ("allocated", "reserved")


@dataclass(frozen=True)
class FitOptions:
    """How a run fits its plan to the budget: the `simulate` config node, checked here only."""

    #: "none": tensors only; "caching": replay the simulation through PyTorch's caching allocator model.
    allocator: str = "none"
    #: "allocated": the planner plans against the tensors' bytes; "reserved": against the allocator's
    #: reserved peak (needs allocator "caching").
    plan_against: str = "allocated"
    #: The planner sees `floor(budget x (1 - margin))`.
    plan_margin_fraction: float = 0.0
    #: Rounds of the reserved-peak loop before it gives up and returns the last plan.
    max_rounds: int = 8

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ConfigError("simulate.allocator", self.allocator, f"unknown allocator model; known: {ALLOCATORS}")
        if self.plan_against not in PLAN_AGAINST:
            raise ConfigError("simulate.plan_against", self.plan_against, f"must be one of {PLAN_AGAINST}")
        if self.plan_against == "reserved" and self.allocator != "caching":
            raise ConfigError("simulate.plan_against", self.plan_against, "needs simulate.allocator=caching")
        check.fraction("simulate.plan_margin_fraction", self.plan_margin_fraction, zero=True, one=False)
        check.integer("simulate.max_rounds", self.max_rounds, 1)

    @property
    def models_allocator(self) -> bool:
        return self.allocator == "caching"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> FitOptions:
        data = dict(data or {})
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"simulate.{unknown[0]}", data[unknown[0]], "unknown field")
        return cls(**data)


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
    options: FitOptions = FitOptions(),
    first_round: FittedPlan | None = None,
) -> FittedPlan:
    """Plan and simulate under `budget_bytes`. Raises the planner's `InfeasibleBudgetError`.

    `first_round`: this planner's one-round fit of the same graph, hardware and budget (the fit
    against the allocated peak): planning against the reserved peak starts with that same plan, so a
    caller that has it (advise plans both targets) passes it instead of planning it twice. Planners
    and the simulator are deterministic, so the result is the one planned from scratch."""
    planning = math.floor(budget_bytes * (1 - options.plan_margin_fraction))
    if first_round is not None and (first_round.rounds != 1 or first_round.planning_budget_bytes != planning
                                    or (first_round.report is None) == options.models_allocator):
        raise ValueError("first_round must be a one-round fit under the same planning budget and allocator model")
    plan_wall = sim_wall = 0.0
    for rounds in range(1, options.max_rounds + 1):
        if planning <= 0:
            raise InfeasibleBudgetError(
                f"no planning budget left: the caching allocator's reserved peak still exceeds the budget of "
                f"{budget_bytes} bytes after {rounds - 1} round(s)"
            )
        if rounds == 1 and first_round is not None:
            plan, result, report = first_round.plan, first_round.result, first_round.report
            plan_wall, sim_wall = first_round.plan_wall_s, first_round.sim_wall_s
        else:
            t0 = time.perf_counter()
            plan = planner.plan(graph, hardware, planning)
            t1 = time.perf_counter()
            result = simulate(graph, plan, hardware, budget_bytes)
            report = allocator_report(graph, plan, result, budget_bytes) if options.models_allocator else None
            t2 = time.perf_counter()
            plan_wall += t1 - t0
            sim_wall += t2 - t1
        done = (
            options.plan_against == "allocated"
            or not result.feasible
            or report.fits
            or rounds == options.max_rounds
        )
        if done:
            return FittedPlan(plan, result, report, planning, rounds, plan_wall, sim_wall)
        planning -= max(report.peak_reserved_bytes - budget_bytes, budget_bytes // 100, 1)
    raise AssertionError("unreachable")
