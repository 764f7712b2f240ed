"""metrics.json: the simulate stage's numbers under the names of docs/contract.md (plain JSON values)."""

from __future__ import annotations

import math

from slackswap.errors import ConfigError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
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
    """Metrics of one run. `ideal` is keep-all simulated with no budget (its peak is the keep-all peak).

    Unknowns are None, never a made-up number: an infeasible run has no step time, so `step_s`,
    `throughput_ratio` and `optimality_gap` are None. `bound_step_s` / `optimality_gap` appear only
    when the plan carries a bound.
    """
    if not ideal.feasible or ideal.budget_bytes is not None:
        raise ConfigError(
            "ideal.budget_bytes", ideal.budget_bytes, "ideal must be keep-all simulated with no budget (None)"
        )
    step_s = result.step_s
    metrics: dict[str, object] = {
        "feasible": bool(result.feasible),
        "infeasible_reason": result.infeasible_reason,
        "throughput_ratio": None if step_s is None else _ratio(ideal.step_s, step_s),
        "step_s": step_s,
        "ideal_step_s": ideal.step_s,
        "peak_activation_bytes": int(result.peak_activation_bytes),
        "keep_all_peak_bytes": int(ideal.peak_activation_bytes),
        "budget_bytes": result.budget_bytes,
        "recompute_s": result.recompute_s,
        "stall_s": result.stall_s,
        "stall_prefetch_s": result.stall_prefetch_s,
        "stall_memory_s": result.stall_memory_s,
        "compute_busy_s": result.compute_busy_s,
        "d2h_bytes": int(result.d2h_bytes),
        "h2d_bytes": int(result.h2d_bytes),
        "d2h_busy_s": result.d2h_busy_s,
        "h2d_busy_s": result.h2d_busy_s,
        "swapped_tensors": int(result.swapped_tensors),
        "recomputed_tensors": int(result.recomputed_tensors),
        "plan_wall_s": plan_wall_s,
        "sim_wall_s": sim_wall_s,
    }
    if result.bound_step_s is not None:
        metrics["bound_step_s"] = result.bound_step_s
        metrics["optimality_gap"] = (
            None if step_s is None else _ratio(step_s - result.bound_step_s, result.bound_step_s)
        )
    for name, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"metrics.{name}", value, "is not finite")
    return metrics


def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den
