"""Solve the bound problem of `milp.model` with HiGHS (scipy.optimize.milp) and read the answer back.

The lower bound we report is always a DUAL bound (the LP relaxation's optimum, or HiGHS's MIP dual
bound), never an incumbent's objective, so a time limit or a nonzero MIP gap weakens it but never
makes it invalid.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from slackswap.errors import InfeasibleBudgetError, SolverError
from slackswap.plan import Decision
from slackswap.planners.base import gib
from slackswap.planners.milp.model import MS_PER_S, BoundProblem

#: scipy.optimize.milp status codes (HiGHS), for notes.
STATUS_TEXT = {
    0: "optimal",
    1: "time_or_iteration_limit",
    2: "infeasible",
    3: "unbounded",
    4: "other",
}


@dataclass(frozen=True)
class BoundSolution:
    """One HiGHS solve. `bound_step_s` is a valid lower bound; `decisions` an incumbent, if any."""

    mode: str  # "exact" (MILP) or "relaxed" (LP relaxation)
    status: str
    bound_step_s: float
    incumbent_step_s: float | None
    mip_gap: float | None
    solve_s: float
    decisions: Mapping[str, Decision] | None
    #: The relaxation's (k, s, r) values per saved tensor, for rounding when there is no incumbent.
    fractions: Mapping[str, tuple[float, float, float]] | None
    #: Branch-and-bound nodes HiGHS explored (None for an LP): the machine-independent measure of effort.
    nodes: int | None = None


def infeasibility_reason(problem: BoundProblem, budget_bytes: int, op_names: tuple[str, ...]) -> str | None:
    """Why no plan can exist, or None. Uses the all-recompute floor: the least any plan keeps resident."""
    worst = int(np.argmax(problem.floor_bytes))
    need = problem.floor_bytes[worst]
    if need <= budget_bytes:
        return None
    return (
        f"MILP infeasible: even recomputing every saved tensor, op {op_names[worst]!r} needs "
        f"{gib(int(need))} resident at its start (its inputs, outputs and the unsaved tensors live "
        f"across it) > budget {gib(budget_bytes)}"
    )


def solve(
    problem: BoundProblem,
    *,
    integral: bool,
    mip_rel_gap: float,
    node_limit: int | None = None,
    time_limit_s: float | None = None,
) -> BoundSolution:
    """Minimise the step time itself: the gap time of the model plus the fixed run time of every op.

    The run time enters as one column fixed at 1 whose cost is that time, so the objective HiGHS sees,
    and therefore its relative MIP gap (`mip_rel_gap`), is relative to the whole step, the quantity
    being optimised, rather than to the stall time alone (a few percent of the step, where a 1e-4 gap
    would demand sub-microsecond proofs). The constant changes no optimum and no bound.
    """
    # scipy.optimize + scipy.sparse (~0.4 s to import) only when a problem is solved, not for every
    # process that loads the planner registry.
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    offset_ms = problem.total_run_s * MS_PER_S
    integrality = problem.integrality if integral else np.zeros_like(problem.integrality)
    integrality = np.append(integrality, 0)
    # Limits that do not depend on the machine's speed (HiGHS is deterministic for a given model and
    # options): the branch-and-bound node count. A wall-clock limit is only applied when asked for,
    # and then two runs may differ (docs/milp.md, "Same config, same plan").
    options: dict[str, object] = {"disp": False}
    if time_limit_s is not None:
        options["time_limit"] = float(time_limit_s)
    if integral:
        options["mip_rel_gap"] = float(mip_rel_gap)
        if node_limit is not None:
            options["node_limit"] = int(node_limit)
    constant_column = sparse.csr_array((problem.a.shape[0], 1))
    start = time.perf_counter()
    res = milp(
        c=np.append(problem.c, offset_ms),
        integrality=integrality,
        bounds=Bounds(np.append(problem.lb, 1.0), np.append(problem.ub, 1.0)),
        constraints=LinearConstraint(sparse.hstack([problem.a, constant_column], format="csr"), problem.lo, problem.hi),
        options=options,
    )
    solve_s = time.perf_counter() - start
    status = STATUS_TEXT.get(res.status, str(res.status))
    if res.status == 4 and "limit reached" in str(res.message).lower():
        # scipy does not map HiGHS' own "solution limit reached" (its node limit) to status 1; the
        # solve stopped at a limit like any other, with a valid dual bound and maybe an incumbent.
        status = STATUS_TEXT[1]
    elif res.status == 2:
        raise InfeasibleBudgetError(f"MILP infeasible (HiGHS: {res.message})")
    if status not in (STATUS_TEXT[0], STATUS_TEXT[1]):
        raise SolverError(f"HiGHS failed on the milp bound problem: status {status}, {res.message}")
    if integral:
        dual = getattr(res, "mip_dual_bound", None)
        if dual is None or not np.isfinite(dual):
            dual = offset_ms  # no dual information: the trivial bound (no gap time at all)
    else:
        # A simplex stopped early has no valid dual bound: fall back to the trivial one (no gap time).
        dual = res.fun if status == STATUS_TEXT[0] and res.fun is not None else offset_ms
    bound_step_s = problem.total_run_s + max(0.0, float(dual) - offset_ms) / MS_PER_S
    decisions = fractions = None
    incumbent = None
    if res.x is not None:
        x = res.x
        fractions = {
            info.name: (float(x[k]), float(x[s]), float(x[r]))
            for info, (k, s, r) in zip(problem.saved, problem.decision_cols, strict=True)
        }
        if integral:
            decisions = {name: _argmax_decision(f) for name, f in fractions.items()}
            incumbent = float(res.fun) / MS_PER_S
    gap = getattr(res, "mip_gap", None)
    nodes = getattr(res, "mip_node_count", None)
    return BoundSolution(
        nodes=None if nodes is None else int(nodes),
        mode="exact" if integral else "relaxed",
        status=status,
        bound_step_s=bound_step_s,
        incumbent_step_s=incumbent,
        mip_gap=None if gap is None else float(gap),
        solve_s=solve_s,
        decisions=decisions,
        fractions=fractions,
    )


def _argmax_decision(fraction: tuple[float, float, float]) -> Decision:
    return (Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE)[int(np.argmax(fraction))]
