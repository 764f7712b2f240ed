"""Smallest feasible budget fraction of a planner on a graph, by bisection.

Feasible at fraction f means: the planner returns a plan for `int(f * keep_all_peak_bytes)` (it
raises InfeasibleBudgetError otherwise) and, when `check` is given, `check(plan, budget_bytes)`
accepts it (the pipeline passes a simulator check). Bisection assumes feasibility is monotone in the
budget, which holds for every planner here up to the granularity of its choices; the answer is the
smallest fraction *checked* feasible, within `tol` of the smallest infeasible one checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.planners.base import Planner


@dataclass(frozen=True)
class MinBudget:
    #: Smallest fraction found feasible (None: not even `hi` is feasible).
    fraction: float | None
    #: Largest fraction found infeasible (None: `lo` itself is feasible).
    infeasible_fraction: float | None
    #: The reason the planner gave at `infeasible_fraction`.
    reason: str | None
    probes: int


def min_feasible_fraction(
    planner: Planner,
    graph: Graph,
    hardware: Hardware,
    keep_all_peak_bytes: int,
    *,
    lo: float = 0.01,
    hi: float = 1.0,
    tol: float = 0.005,
    check: Callable[[Plan, int], bool] | None = None,
) -> MinBudget:
    if not 0 < lo < hi <= 1:
        raise ConfigError("min_feasible_fraction.lo/hi", (lo, hi), "need 0 < lo < hi <= 1")
    if not tol > 0:
        raise ConfigError("min_feasible_fraction.tol", tol, "must be > 0")
    probes = 0
    reasons: dict[float, str] = {}

    def feasible(fraction: float) -> bool:
        nonlocal probes
        probes += 1
        budget = int(fraction * keep_all_peak_bytes)
        try:
            plan = planner.plan(graph, hardware, budget)
        except InfeasibleBudgetError as exc:
            reasons[fraction] = exc.reason
            return False
        if check is not None and not check(plan, budget):
            reasons[fraction] = "the plan failed the check"
            return False
        return True

    if not feasible(hi):
        return MinBudget(None, hi, reasons[hi], probes)
    if feasible(lo):
        return MinBudget(lo, None, None, probes)
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return MinBudget(hi, lo, reasons[lo], probes)
