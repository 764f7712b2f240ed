"""The honest floor of an infeasible run: the least budget at which its planner returns a plan.

A planner that cannot meet a budget knows only that its candidates peak above it; the peak of the
last candidate it tried is not the least it could reach (bert_large's slackswap stopped at 6.8 GiB
with the budget at 0.5 GB, yet plans within 0.9 GB). So the run finds the floor itself, by bisection on
the budget between the budget that failed and the keep-all peak (where every planner returns a plan),
to a relative precision of `REL_TOL`, then tightened to the peak of the plan found there when the
planner plans at that peak too: at `floor_bytes` the planner returns a plan, at the bisection's
infeasible end (within `REL_TOL` below) it did not. Bisection is exact where feasibility is monotone in the
budget; `docs/planners.md` names the one planner where it is not everywhere and what the floor then
means.

Only infeasible runs pay for this (about 20 planner calls), and only once per process for a
(workload, planner) pair: a budget sweep's infeasible points share one floor. Planners themselves stay
one pass, linear in depth.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.planners.base import Planner
from slackswap.schedule.replay import estimate_plan

#: Bisection stops when the feasible and infeasible budgets are this close, relative to the feasible.
REL_TOL = 1e-4


@dataclass(frozen=True)
class Floor:
    #: Least budget found at which the planner returns a plan; None when not even `hi_bytes` works.
    floor_bytes: int | None
    #: Largest budget found at which it raised (the budget of the run, or above it).
    infeasible_bytes: int
    probes: int


def _plan(planner: Planner, graph: Graph, hardware: Hardware, budget_bytes: int) -> Plan | None:
    try:
        return planner.plan(graph, hardware, budget_bytes)
    except InfeasibleBudgetError:
        return None


def least_feasible_budget(
    planner: Planner, graph: Graph, hardware: Hardware, infeasible_bytes: int, hi_bytes: int, rel_tol: float = REL_TOL
) -> Floor:
    """Bisect between `infeasible_bytes` (where the planner raised) and `hi_bytes` (tried first).

    The floor is then tightened to the peak of the plan found at the bisection's feasible end when
    the planner also plans at that peak (one more probe): the least peak the planner reaches, to the
    byte for a planner whose most frugal plan does not depend on the budget (selective_recompute,
    full_recompute, keep_all), and never above the bisection's budget.
    """
    probes = 1
    plan = None if hi_bytes <= infeasible_bytes else _plan(planner, graph, hardware, hi_bytes)
    if plan is None:
        return Floor(None, max(infeasible_bytes, hi_bytes), probes)
    lo, hi = infeasible_bytes, hi_bytes
    while hi - lo > max(1, int(hi * rel_tol)):
        mid = (lo + hi) // 2
        probes += 1
        found = _plan(planner, graph, hardware, mid)
        if found is not None:
            hi, plan = mid, found
        else:
            lo = mid
    peak = estimate_plan(graph, plan, hardware).peak_bytes
    if lo < peak < hi:
        probes += 1
        if _plan(planner, graph, hardware, peak) is not None:
            hi = peak
    return Floor(hi, lo, probes)


_FLOORS: dict[tuple[str, str, str], Floor] = {}


def cached_floor(
    key: tuple[str, str, str], planner: Planner, graph: Graph, hardware: Hardware, infeasible_bytes: int, hi_bytes: int
) -> Floor:
    """`least_feasible_budget`, once per key (workload, planner, options) while budgets below the floor
    found ask again; a budget above a cached floor's infeasible bound searches afresh."""
    cached = _FLOORS.get(key)
    if cached is not None and cached.floor_bytes is not None and infeasible_bytes <= cached.infeasible_bytes:
        return cached
    found = least_feasible_budget(planner, graph, hardware, infeasible_bytes, hi_bytes)
    _FLOORS[key] = found
    return found
