"""`recompute_knapsack`: an exact 0/1 recompute knapsack after the idea of PyTorch's
activation-memory-budget partitioner (not torch's algorithm: `torch_budget` is that, with its budget
fraction, min cut and FLOP prices).

torch._functorch.partitioners (`activation_memory_budget`) picks which activations to recompute by
solving a 0/1 knapsack: recompute runtime against memory saved (with a dp, greedy or ILP solver).
Here, over saved tensors priced by time and a byte budget instead: minimise the summed recompute
time of the chosen tensors subject to the bytes they free covering the excess of the keep-all peak
over the budget, solved exactly (identical items are grouped, then an integer program with HiGHS at
zero gap; `solve_knapsack`). Each tensor is priced by its standalone regeneration chain (an upper
bound on its true marginal cost), as PyTorch prices nodes independently. Layer boundaries are never
recomputed (see `analysis`). If the schedule of the optimal set still peaks above the budget (bytes
freed at the end of forward are not all the story: recompute in backward allocates again), the
excess is added to the requirement and the knapsack re-solved, up to `max_rounds` times (not
re-solved while the last optimal set still frees the larger requirement: it is still optimal).
Never swaps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from slackswap import validation as check
from slackswap.errors import InfeasibleBudgetError, SolverError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget, gib
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import analyse
from slackswap.planners.support.budget_check import scheduled_peak
from slackswap.planners.support.candidates import keep_chain_candidates
from slackswap.planners.support.greedy import keep_all_if_it_fits, recompute_candidates


def milp(**kwargs):
    """scipy.optimize.milp, imported when a knapsack is solved (scipy.optimize takes ~0.4 s to import),
    not by every process that loads the planner registry."""
    from scipy.optimize import milp as scipy_milp

    return scipy_milp(**kwargs)


def solve_knapsack(sizes: Sequence[int], costs: Sequence[float], need_bytes: int) -> list[int] | None:
    """Indices of a minimum-total-cost subset whose sizes sum to at least `need_bytes`; None if even
    all items fall short. Exact: identical (size, cost) items become one bounded integer variable."""
    if need_bytes <= 0:
        return []
    if sum(sizes) < need_bytes:
        return None
    groups: dict[tuple[int, float], list[int]] = {}
    for i, key in enumerate(zip(sizes, costs, strict=True)):
        groups.setdefault(key, []).append(i)
    keys = list(groups)
    scale = math.gcd(*(s for s, _ in keys if s > 0)) or 1
    size = np.array([s // scale for s, _ in keys], dtype=float)
    cost = np.array([c for _, c in keys], dtype=float)
    count = np.array([len(groups[k]) for k in keys], dtype=float)
    need = -(-need_bytes // scale)
    from scipy.optimize import Bounds, LinearConstraint

    result = milp(
        c=cost,
        constraints=LinearConstraint(size[np.newaxis, :], lb=need, ub=np.inf),
        integrality=np.ones(len(keys)),
        bounds=Bounds(np.zeros(len(keys)), count),
        options={"mip_rel_gap": 0.0},
    )
    if not result.success:
        if result.status == 2:  # proven infeasible (the sum check above makes this unexpected)
            raise InfeasibleBudgetError(f"recompute_knapsack: HiGHS proved the knapsack infeasible: {result.message}")
        raise SolverError(
            f"recompute_knapsack: HiGHS failed on the knapsack (status {result.status}): {result.message}"
        )
    taken = np.rint(result.x).astype(int)
    chosen = [i for k, n in zip(keys, taken, strict=True) for i in groups[k][:n]]
    if sum(sizes[i] for i in chosen) < need_bytes:
        raise SolverError("recompute_knapsack: HiGHS returned a knapsack that does not cover the need")
    return chosen


@register_planner("recompute_knapsack")
class RecomputeKnapsack:
    name = "recompute_knapsack"

    def __init__(self, max_rounds: int = 30):
        self.max_rounds = check.integer("planner.options.max_rounds", max_rounds, 1)

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        analysis = analyse(graph, hardware)
        unconstrained = keep_all_if_it_fits(graph, hardware, analysis, budget_bytes, self.name)
        if unconstrained is not None:
            return unconstrained
        keep = {t: Decision.KEEP for t in analysis.tensors}
        # Earliest-produced first, so equal items are taken from the layers alive longest.
        candidates = recompute_candidates(graph, analysis, set())
        sizes = [analysis.tensors[t].size_bytes for t in candidates]
        costs = [analysis.tensors[t].regen_s for t in candidates]
        need = analysis.keep_all_peak_bytes - budget_bytes
        peak = analysis.keep_all_peak_bytes
        # A set chosen again has the same schedule and the same peak, which did not fit: its build and
        # replay are not repeated. (When the excess is a few bytes, the knapsack of the next round
        # often picks the same set: on the traced 64-layer Llama-2-70B at 50 % it did for all 30 rounds.)
        peak_of_set: dict[frozenset[int], int] = {}
        chosen: list[int] | None = None
        for round_ in range(self.max_rounds):
            # The need only grows. The last optimum still covering it is still optimal (every set covering
            # the larger need covers the smaller one, and none of those cost less): kept, not re-solved.
            if chosen is None or sum(sizes[i] for i in chosen) < need:
                chosen = solve_knapsack(sizes, costs, need)
            if chosen is None:
                why = (f"needs {gib(need)} freed, more than the {gib(sum(sizes))} of recomputable activations "
                       f"(last plan peaked at {gib(peak)})")
                return self._recompute_all(graph, hardware, budget_bytes, keep, candidates, peak_of_set, why)
            seen = peak_of_set.get(frozenset(chosen))
            if seen is not None:
                peak = seen
                need += peak - budget_bytes
                continue
            decisions = dict(keep)
            decisions.update({candidates[i]: Decision.RECOMPUTE for i in chosen})
            plan, peak = scheduled_peak(
                graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
                notes={"knapsack_need_bytes": need, "knapsack_rounds": round_ + 1,
                       "knapsack_recompute_s": sum(costs[i] for i in chosen)},
            )
            if peak <= budget_bytes:
                return keep_chain_candidates(graph, hardware, budget_bytes, plan)
            peak_of_set[frozenset(chosen)] = peak
            need += peak - budget_bytes
        why = f"after {self.max_rounds} rounds the plan still peaks at {gib(peak)}"
        return self._recompute_all(graph, hardware, budget_bytes, keep, candidates, peak_of_set, why)

    def _recompute_all(self, graph, hardware, budget_bytes, keep, candidates, peak_of_set, why: str) -> Plan:
        """The strategy's most frugal plan, every candidate recomputed (what PyTorch's partitioner does at
        a budget of 0), when the knapsack rounds end without a fit. Without it feasibility was not
        monotone in the budget: the rounds' growing requirement could overshoot every set at one budget
        while a lower budget's rounds found a fit (docs/planners.md, "Floors"). Plans the rounds find are
        unchanged."""
        everything = frozenset(range(len(candidates)))
        peak = peak_of_set.get(everything)
        if peak is None:
            decisions = dict(keep)
            decisions.update(dict.fromkeys(candidates, Decision.RECOMPUTE))
            plan, peak = scheduled_peak(
                graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
                notes={"knapsack_fallback": "recompute every candidate"},
            )
            if peak <= budget_bytes:
                return plan
        raise InfeasibleBudgetError(
            f"recompute_knapsack: budget {gib(budget_bytes)}: the knapsack {why}, and recomputing every "
            f"candidate still peaks above the budget"
        )
