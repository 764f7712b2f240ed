"""`milp`: the exact optimum of a joint keep/swap/recompute MILP (HiGHS), and a lower bound on step time.

Two products (docs/milp.md):
- `Plan.bound_step_s`: the optimum (a dual bound) of the bound problem of `milp_model`, every
  constraint of which is a necessary condition of any simulated execution of a valid plan whose run
  steps follow graph order. Exact MILP for models of up to `exact_max_layers` layers; beyond that the
  LP relaxation's optimum (and the MIP dual bound if a time-limited MILP improves on it).
- the plan: the MILP incumbent's decisions turned into a schedule by the shared `build_schedule`.
  The bound problem relaxes memory timing (fractional offload/prefetch progress, coarse windows),
  so its decisions may not fit when scheduled. Then the MILP is re-solved for the PLAN only with the
  budget lowered by the excess the schedule showed (never for the bound), up to `max_repair_rounds`.
"""

from __future__ import annotations

import time

import numpy as np

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget, gib
from slackswap.planners.milp_model import GRANULARITIES, build_bound_problem
from slackswap.planners.milp_solve import BoundSolution, infeasibility_reason, solve
from slackswap.planners.registry import register_planner
from slackswap.planners.schedule import build_schedule
from slackswap.planners.timeline import estimate_plan


def _positive_number(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        raise ConfigError(field, value, "must be a positive finite number")
    return float(value)


def _non_negative_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(field, value, "must be an integer >= 0")
    return value


@register_planner("milp")
class MilpPlanner:
    name = "milp"

    def __init__(
        self,
        time_limit_s: float = 60.0,
        mip_rel_gap: float = 1e-4,
        granularity: str = "auto",
        op_level_max_ops: int = 80,
        exact_max_layers: int = 8,
        max_repair_rounds: int = 8,
    ):
        self.time_limit_s = _positive_number("planner.options.time_limit_s", time_limit_s)
        if isinstance(mip_rel_gap, bool) or not isinstance(mip_rel_gap, (int, float)) or not 0 <= mip_rel_gap < 1:
            raise ConfigError("planner.options.mip_rel_gap", mip_rel_gap, "must be in [0, 1)")
        self.mip_rel_gap = float(mip_rel_gap)
        if granularity not in ("auto", *GRANULARITIES):
            raise ConfigError("planner.options.granularity", granularity, f"known: {('auto', *GRANULARITIES)}")
        self.granularity = granularity
        self.op_level_max_ops = _non_negative_int("planner.options.op_level_max_ops", op_level_max_ops)
        self.exact_max_layers = _non_negative_int("planner.options.exact_max_layers", exact_max_layers)
        self.max_repair_rounds = _non_negative_int("planner.options.max_repair_rounds", max_repair_rounds)

    def _granularity_for(self, graph: Graph) -> str:
        if self.granularity != "auto":
            return self.granularity
        return "op" if len(graph.ops) <= self.op_level_max_ops else "layer"

    def bound(self, graph: Graph, hardware: Hardware, budget_bytes: int) -> tuple[BoundSolution, str]:
        """Solve the bound problem (exact or relaxed by model size). Raises InfeasibleBudgetError."""
        granularity = self._granularity_for(graph)
        problem = build_bound_problem(graph, hardware, budget_bytes, granularity)
        reason = infeasibility_reason(problem, budget_bytes, tuple(op.name for op in graph.ops))
        if reason is not None:
            raise InfeasibleBudgetError(reason, min_feasible_bytes=max(problem.floor_bytes))
        if graph.num_layers <= self.exact_max_layers:
            exact = solve(problem, integral=True, time_limit_s=self.time_limit_s, mip_rel_gap=self.mip_rel_gap)
            return exact, granularity
        relaxed = solve(problem, integral=False, time_limit_s=self.time_limit_s, mip_rel_gap=self.mip_rel_gap)
        mip = solve(problem, integral=True, time_limit_s=self.time_limit_s, mip_rel_gap=self.mip_rel_gap)
        if mip.bound_step_s > relaxed.bound_step_s:
            return mip, granularity
        # The LP bound is the stronger one: keep it, with the MIP's incumbent for the plan.
        return (
            BoundSolution(
                mode="relaxed",
                status=f"lp {relaxed.status}; mip {mip.status}",
                bound_step_s=relaxed.bound_step_s,
                incumbent_step_s=mip.incumbent_step_s,
                mip_gap=mip.mip_gap,
                solve_s=relaxed.solve_s + mip.solve_s,
                decisions=mip.decisions if mip.decisions is not None else _rounded(relaxed),
                fractions=relaxed.fractions,
            ),
            granularity,
        )

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        start = time.perf_counter()
        if budget_bytes is None:
            keep = {t.name: Decision.KEEP for t in graph.saved_tensors}
            return build_schedule(
                graph, keep, planner=self.name, budget_bytes=None, hardware=hardware,
                bound_step_s=sum(op.duration_s for op in graph.ops),
                notes={"milp_mode": "no_budget", "milp_bound_basis": "serial compute stream"},
            )
        solution, granularity = self.bound(graph, hardware, budget_bytes)
        notes: dict[str, object] = {
            "milp_mode": solution.mode,
            "milp_status": solution.status,
            "milp_mip_gap": solution.mip_gap,
            "milp_solve_s": round(solution.solve_s, 3),
            "milp_granularity": granularity,
            "milp_bound_step_s": solution.bound_step_s,
            "milp_model_step_s": solution.incumbent_step_s,
        }
        decisions = solution.decisions
        if decisions is None:
            raise InfeasibleBudgetError(
                f"milp: HiGHS found no integer solution within {self.time_limit_s} s ({solution.status}); "
                f"lower bound {solution.bound_step_s:.6f} s"
            )
        plan_budget = budget_bytes
        for round_ in range(self.max_repair_rounds + 1):
            plan = build_schedule(
                graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
                bound_step_s=solution.bound_step_s,
                notes={**notes, "milp_repair_rounds": round_, "milp_plan_budget_bytes": plan_budget,
                       "plan_wall_s_inner": round(time.perf_counter() - start, 3)},
            )
            peak = estimate_plan(graph, plan, hardware).peak_bytes
            if peak <= budget_bytes:
                return plan
            if round_ == self.max_repair_rounds:
                break
            # Plan-only re-solve with the excess taken off the budget; the bound is not touched.
            floor = max(build_bound_problem(graph, hardware, plan_budget, granularity).floor_bytes)
            if plan_budget <= floor:
                break
            # Never below the all-recompute floor, where no decisions exist at all.
            plan_budget = max(floor, plan_budget - (peak - budget_bytes))
            problem = build_bound_problem(graph, hardware, plan_budget, granularity)
            repaired = solve(problem, integral=True, time_limit_s=self.time_limit_s, mip_rel_gap=self.mip_rel_gap)
            if repaired.decisions is None:
                break
            decisions = repaired.decisions
        raise InfeasibleBudgetError(
            f"milp: the MILP's decisions, scheduled by build_schedule, peak at {gib(peak)} > budget "
            f"{gib(budget_bytes)} after {round_} repair round(s) (lower bound {solution.bound_step_s:.6f} s "
            "still holds)"
        )


def _rounded(relaxed: BoundSolution) -> dict[str, Decision] | None:
    """Largest-fraction rounding of the LP solution: a plan of last resort when the MIP has no incumbent."""
    if relaxed.fractions is None:
        return None
    order = (Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE)
    return {name: order[int(np.argmax(f))] for name, f in relaxed.fractions.items()}
