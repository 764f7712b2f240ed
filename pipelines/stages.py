"""profile -> plan -> simulate for one resolved config, writing the run-directory files of BRIEF §6.

Thin wiring only: every modelling decision lives in `slackswap/`. What this module adds is
- validation of all inputs before any work (so a bad value fails with its field named),
- a per-process cache of the profile graph and the ideal (keep-all, no limit) simulation per
  (model, hardware): in a sweep with the basic launcher, ten planners on one model profile it once,
- turning an infeasible budget (planner or simulator) into a recorded outcome instead of a crash,
- wall-clock timings per stage, so the per-job overhead can be reported.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.records import RunStatus
from slackswap.budget import Budget
from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision


@dataclass(frozen=True)
class Inputs:
    model: ModelConfig
    hardware: Hardware
    budget: Budget
    planner_name: str
    planner_options: Mapping[str, Any]
    profile_source: str
    profile_options: Mapping[str, Any]


def validate_inputs(resolved: Mapping[str, Any]) -> Inputs:
    """All value checks of a job, before any work starts. Raises `ConfigError` naming the field."""
    planner = resolved["planner"]
    if not isinstance(planner.get("name"), str) or not planner["name"]:
        raise ConfigError("planner.name", planner.get("name"), "must be a non-empty planner name")
    inputs = Inputs(
        model=ModelConfig.from_dict(resolved["model"]),
        hardware=Hardware.from_dict(resolved["hardware"]),
        budget=Budget.from_dict(resolved["budget"]),
        planner_name=planner["name"],
        planner_options=dict(planner.get("options") or {}),
        profile_source=resolved["profile"]["source"],
        profile_options=dict(resolved["profile"].get("options") or {}),
    )
    from slackswap.profile.sources import check_profile_source

    check_profile_source(inputs.profile_source)
    inputs.hardware.peak_for(inputs.model.dtype)  # e.g. bf16 on a V100: ConfigError naming model.dtype
    return inputs


@dataclass(frozen=True)
class Baseline:
    """The profile graph and its ideal simulation: shared by every planner and budget of one workload."""

    graph: Any
    ideal: Any
    profile_wall_s: float
    ideal_sim_wall_s: float


_BASELINES: dict[str, Baseline] = {}


def _baseline_key(resolved: Mapping[str, Any]) -> str:
    return json.dumps(
        {"model": resolved["model"], "hardware": resolved["hardware"], "profile": resolved["profile"]}, sort_keys=True
    )


def baseline(inputs: Inputs, resolved: Mapping[str, Any]) -> tuple[Baseline, bool]:
    """(baseline, cache_hit). Keyed on the full resolved model, hardware and profile nodes, not preset names."""
    key = _baseline_key(resolved)
    if key in _BASELINES:
        return _BASELINES[key], True
    from slackswap.profile.sources import profile_graph
    from slackswap.simulate.metrics import simulate_ideal

    t0 = time.perf_counter()
    graph = profile_graph(inputs.profile_source, inputs.model, inputs.hardware, **inputs.profile_options)
    t1 = time.perf_counter()
    ideal = simulate_ideal(graph, inputs.hardware)
    t2 = time.perf_counter()
    if not ideal.feasible:
        raise RuntimeError(f"the keep-all plan with no memory limit is infeasible: {ideal.infeasible_reason}")
    _BASELINES[key] = Baseline(graph, ideal, t1 - t0, t2 - t1)
    return _BASELINES[key], False


@dataclass
class Outcome:
    status: RunStatus
    failure_reason: str
    metrics: dict[str, Any]
    timings_s: dict[str, float]
    #: Human-readable facts for the printed summary (swapped / recomputed tensors, ...).
    facts: dict[str, Any] = field(default_factory=dict)


def execute(inputs: Inputs, resolved: Mapping[str, Any], run_dir: Path, timings: dict[str, float]) -> Outcome:
    """Run the stages and write profile.csv, graph.json, plan.json, metrics.json, trace.json, timeline.png.

    `timings` is filled as each stage finishes, so a job that fails midway still reports where its
    time went.
    """
    from slackswap.graph_io import write_graph_json
    from slackswap.plan_io import write_plan_json
    from slackswap.planners.registry import get_planner
    from slackswap.profile.report import write_profile_csv
    from slackswap.schedule.validate import validate_plan
    from slackswap.simulate import simulate
    from slackswap.simulate.metrics import compute_metrics, planner_infeasible_metrics
    from slackswap.simulate.timeline import write_timeline_png
    from slackswap.simulate.trace import write_trace_json

    base, hit = baseline(inputs, resolved)
    timings["profile_s"] = 0.0 if hit else base.profile_wall_s
    timings["ideal_sim_s"] = 0.0 if hit else base.ideal_sim_wall_s
    graph, ideal = base.graph, base.ideal

    t0 = time.perf_counter()
    write_profile_csv(graph, run_dir / "profile.csv")
    write_graph_json(graph, run_dir / "graph.json")
    timings["write_profile_s"] = time.perf_counter() - t0

    keep_all_peak_bytes = int(ideal.peak_activation_bytes)
    budget_bytes = inputs.budget.resolve_bytes(keep_all_peak_bytes)
    planner = get_planner(inputs.planner_name, **inputs.planner_options)

    t0 = time.perf_counter()
    try:
        plan = planner.plan(graph, inputs.hardware, budget_bytes)
    except InfeasibleBudgetError as exc:
        metrics = planner_infeasible_metrics(exc, ideal, budget_bytes, plan_wall_s=time.perf_counter() - t0)
        _write_json(run_dir / "metrics.json", metrics)
        return Outcome(RunStatus.INFEASIBLE, f"planner: {exc.reason}", metrics, timings)
    finally:
        timings["plan_s"] = time.perf_counter() - t0
    plan_wall_s = timings["plan_s"]
    write_plan_json(plan, run_dir / "plan.json")

    validate_plan(graph, plan)
    t0 = time.perf_counter()
    result = simulate(graph, plan, inputs.hardware, budget_bytes)
    sim_wall_s = time.perf_counter() - t0
    timings["sim_s"] = sim_wall_s

    metrics = compute_metrics(result, ideal, plan_wall_s=plan_wall_s, sim_wall_s=sim_wall_s)
    t0 = time.perf_counter()
    _write_json(run_dir / "metrics.json", metrics)
    write_trace_json(result, run_dir / "trace.json")
    write_timeline_png(result, run_dir / "timeline.png", budget_bytes)
    timings["write_results_s"] = time.perf_counter() - t0

    facts = {"swapped": plan.tensors_with(Decision.SWAP), "recomputed": plan.tensors_with(Decision.RECOMPUTE)}
    if result.feasible:
        return Outcome(RunStatus.OK, "", metrics, timings, facts)
    return Outcome(RunStatus.INFEASIBLE, f"simulator: {result.infeasible_reason}", metrics, timings, facts)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(dict(data), indent=2, sort_keys=True) + "\n")
