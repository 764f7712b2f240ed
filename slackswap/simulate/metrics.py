"""metrics.json: the simulate stage's numbers under the names of docs/contract.md (plain JSON values),
for a simulated run (`compute_metrics`) and for a run that ended infeasible before any simulation
(`unsimulated_metrics`), with one key set: the `simulation` group of `slackswap.metrics_table`, which
declares each name, unit and meaning (checked on every build)."""

from __future__ import annotations

import math

from slackswap.errors import ConfigError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.metrics_table import check_group
from slackswap.schedule.build import keep_all_plan
from slackswap.simulate.engine import simulate
from slackswap.simulate.result import SimResult


def simulate_ideal(graph: Graph, hardware: Hardware) -> SimResult:
    """The ideal: the keep-all plan simulated with no budget. Its peak is the keep-all peak."""
    return simulate(graph, keep_all_plan(graph), hardware, None)


def compute_metrics(
    result: SimResult,
    ideal: SimResult,
    *,
    plan_wall_s: float | None,
    sim_wall_s: float | None,
) -> dict[str, object]:
    """Metrics of one simulated run. `ideal` is keep-all simulated with no budget (its peak is the
    keep-all peak).

    Unknowns are None, never a made-up number: an infeasible run has no step time, so `step_s`,
    `throughput_ratio` and `optimality_gap` are None, and a plan without a bound has `bound_step_s`
    and `optimality_gap` None.
    """
    return _metrics(ideal, result.budget_bytes, result=result, plan_wall_s=plan_wall_s, sim_wall_s=sim_wall_s)


def unsimulated_metrics(
    ideal: SimResult,
    budget_bytes: int | None,
    reason: str,
    *,
    min_feasible_bytes: int | None = None,
    plan_wall_s: float | None = None,
) -> dict[str, object]:
    """Metrics of a run that ended infeasible before any simulation (the planner raised
    InfeasibleBudgetError, or static memory alone fills the device): the same keys as
    `compute_metrics`, everything a simulation would have given None."""
    return _metrics(
        ideal, budget_bytes, reason=reason, min_feasible_bytes=min_feasible_bytes, plan_wall_s=plan_wall_s
    )


def _metrics(
    ideal: SimResult,
    budget_bytes: int | None,
    *,
    result: SimResult | None = None,
    reason: str | None = None,
    min_feasible_bytes: int | None = None,
    plan_wall_s: float | None,
    sim_wall_s: float | None = None,
) -> dict[str, object]:
    """The simulation's part of metrics.json, built here only: one key set for every outcome."""
    if not ideal.feasible or ideal.budget_bytes is not None:
        raise ConfigError(
            "ideal.budget_bytes", ideal.budget_bytes, "ideal must be keep-all simulated with no budget (None)"
        )
    r = result
    step_s = None if r is None else r.step_s
    bound_step_s = None if r is None else r.bound_step_s

    metrics: dict[str, object] = {
        "feasible": bool(r is not None and r.feasible),
        "infeasible_reason": reason if r is None else r.infeasible_reason,
        "min_feasible_bytes": min_feasible_bytes,
        "throughput_ratio": None if step_s is None else _ratio(ideal.step_s, step_s),
        "step_s": step_s,
        "ideal_step_s": ideal.step_s,
        "peak_activation_bytes": None if r is None else int(r.peak_activation_bytes),
        "keep_all_peak_bytes": int(ideal.peak_activation_bytes),
        "budget_bytes": budget_bytes,
        "recompute_s": None if r is None else r.recompute_s,
        "stall_s": None if r is None else r.stall_s,
        "stall_prefetch_s": None if r is None else r.stall_prefetch_s,
        "stall_memory_s": None if r is None else r.stall_memory_s,
        "stall_offload_s": None if r is None else r.stall_offload_s,
        "pin_s": None if r is None else r.pin_s,
        "compute_busy_s": None if r is None else r.compute_busy_s,
        "d2h_bytes": None if r is None else int(r.d2h_bytes),
        "h2d_bytes": None if r is None else int(r.h2d_bytes),
        "host_peak_bytes": None if r is None else int(r.host_peak_bytes),
        "host_pinned_bytes": None if r is None else int(r.host_pinned_bytes),
        "d2h_busy_s": None if r is None else r.d2h_busy_s,
        "h2d_busy_s": None if r is None else r.h2d_busy_s,
        "swapped_tensors": None if r is None else int(r.swapped_tensors),
        "recomputed_tensors": None if r is None else int(r.recomputed_tensors),
        "bound_step_s": bound_step_s,
        "optimality_gap": (
            None if step_s is None or bound_step_s is None else _ratio(step_s - bound_step_s, bound_step_s)
        ),
        "plan_wall_s": plan_wall_s,
        "sim_wall_s": sim_wall_s,
    }
    for name, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"metrics.{name}", value, "is not finite")
    check_group(metrics, "simulation")
    return metrics


def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den
