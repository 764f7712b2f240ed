"""profile -> plan -> simulate for one resolved config, writing the run-directory files of docs/contract.md.

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
from slackswap.memory.training import TrainingConfig
from slackswap.model_config import ModelConfig
from slackswap.node import Node
from slackswap.plan import Decision
from slackswap.profile.torch.spec import TorchSpec

PLOT_LEVELS: tuple[str, ...] = ("auto", "all", "summary", "none")


def plot_level(resolved: Mapping[str, Any], multirun: bool) -> str:
    """The effective `plots` level of a job: "all", "summary" or "none" ("auto" depends on the mode)."""
    level = resolved.get("plots", "auto")
    if level not in PLOT_LEVELS:
        raise ConfigError("plots", level, f"must be one of {', '.join(PLOT_LEVELS)}")
    if level == "auto":
        return "summary" if multirun else "all"
    return level


@dataclass(frozen=True)
class Inputs:
    model: ModelConfig
    #: The per-rank hardware on `node`: the link at the rates this GPU really gets (slackswap.sharing).
    hardware: Hardware
    budget: Budget
    planner_name: str
    planner_options: Mapping[str, Any]
    training: TrainingConfig = field(default_factory=TrainingConfig)
    allocator: str = "none"
    plan_against: str = "allocated"
    plan_margin_fraction: float = 0.0
    #: Draw this run's timeline.png (plots level "all").
    draw_timeline: bool = True
    #: `slackswap.profile.sources` name and options (a preset's `torch` node selects `torch`).
    profile_source: str = "analytic"
    profile_options: Mapping[str, Any] = field(default_factory=dict)
    #: Set when the source is `torch`: the graph is traced from the real model.
    torch_spec: TorchSpec | None = None
    #: The server (conf/node) and what sharing it left each GPU (`slackswap.sharing.SharedLink`).
    node: Node | None = None
    shared_link: Any = None
    #: The GPU alone (its preset link), kept when the node changed the link: the run also plans and
    #: simulates it there, so the table shows what sharing cost (`alone_throughput_ratio`).
    alone_hardware: Hardware | None = None


ALLOCATORS = ("none", "caching")
PLAN_AGAINST = ("allocated", "reserved")


def _simulate_options(node: Mapping[str, Any]) -> dict[str, Any]:
    node = dict(node or {})
    allocator = node.get("allocator", "none")
    against = node.get("plan_against", "allocated")
    margin = node.get("plan_margin_fraction", 0.0)
    if allocator not in ALLOCATORS:
        raise ConfigError("simulate.allocator", allocator, f"unknown allocator model; known: {ALLOCATORS}")
    if against not in PLAN_AGAINST:
        raise ConfigError("simulate.plan_against", against, f"must be one of {PLAN_AGAINST}")
    if against == "reserved" and allocator != "caching":
        raise ConfigError("simulate.plan_against", against, "needs simulate.allocator=caching")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ConfigError("simulate.plan_margin_fraction", margin, "must be in [0, 1)")
    return {"allocator": allocator, "plan_against": against, "plan_margin_fraction": float(margin)}


def validate_inputs(resolved: Mapping[str, Any], multirun: bool = False) -> Inputs:
    """All value checks of a job, before any work starts. Raises `ConfigError` naming the field."""
    planner = resolved["planner"]
    if not isinstance(planner.get("name"), str) or not planner["name"]:
        raise ConfigError("planner.name", planner.get("name"), "must be a non-empty planner name")
    from slackswap.profile.sources import select_source
    from slackswap.profile.torch import spec_from_options

    model = dict(resolved["model"])
    torch_node = model.pop("torch", None)
    profile = resolved["profile"]
    source, options = select_source(profile["source"], profile.get("options") or {}, torch_node)
    model_config = ModelConfig.from_dict(model)
    from slackswap.sharing import shared_hardware

    node = Node.from_dict(resolved["node"])
    alone = Hardware.from_dict(resolved["hardware"])
    hardware, shared = shared_hardware(alone, node)
    inputs = Inputs(
        model=model_config,
        hardware=hardware,
        budget=Budget.from_dict(resolved["budget"]),
        planner_name=planner["name"],
        planner_options=dict(planner.get("options") or {}),
        training=TrainingConfig.from_dict(resolved.get("training") or {}),
        **_simulate_options(resolved.get("simulate")),
        draw_timeline=plot_level(resolved, multirun) == "all",
        profile_source=source,
        profile_options=options,
        torch_spec=spec_from_options(model_config, options) if source == "torch" else None,
        node=node,
        shared_link=shared,
        alone_hardware=None if hardware == alone else alone,
    )
    inputs.hardware.peak_for(inputs.model.dtype)  # e.g. bf16 on a V100: ConfigError naming model.dtype
    inputs.training.check_model_dtype(inputs.model.dtype)
    from slackswap.planners.registry import get_planner

    # Unknown planner names and options fail here, before profiling, naming what was asked for.
    get_planner(inputs.planner_name, **inputs.planner_options)
    return inputs


@dataclass(frozen=True)
class Baseline:
    """The profile graph and its ideal simulation: shared by every planner and budget of one workload."""

    graph: Any
    ideal: Any
    profile_wall_s: float
    ideal_sim_wall_s: float
    #: Traced graphs only: the keep-all peak of the analytic graph of the same shape, for comparison.
    analytic_peak_bytes: int | None = None
    #: Traced graphs only: the analytic graph (profile.csv's formula column).
    analytic_graph: Any = None


def analytic_twin(model: ModelConfig, spec: TorchSpec) -> ModelConfig:
    """The analytic model of a traced preset's shape: sdpa is a fused kernel (`flash`), eager is eager."""
    from dataclasses import replace

    return replace(model, attention="flash" if spec.attention == "sdpa" else "eager")


_BASELINES: dict[str, Baseline] = {}


def _baseline_key(resolved: Mapping[str, Any]) -> str:
    # The training recipe shapes the optimizer-step ops (when the model includes them).
    node = {
        "model": resolved["model"],
        "hardware": resolved["hardware"],
        "node": resolved.get("node"),
        "training": resolved.get("training"),
        "profile": resolved.get("profile"),
    }
    return json.dumps(node, sort_keys=True)


def baseline(inputs: Inputs, resolved: Mapping[str, Any]) -> tuple[Baseline, bool]:
    """(baseline, cache_hit). Keyed on the full resolved model, hardware, training and profile nodes,
    not preset names."""
    key = _baseline_key(resolved)
    if key in _BASELINES:
        return _BASELINES[key], True
    from slackswap.profile import build_graph
    from slackswap.profile.sources import profile_graph
    from slackswap.simulate.metrics import simulate_ideal

    t0 = time.perf_counter()
    graph = profile_graph(
        inputs.profile_source, inputs.model, inputs.hardware, inputs.training, **inputs.profile_options
    )
    t1 = time.perf_counter()
    ideal = simulate_ideal(graph, inputs.hardware)
    t2 = time.perf_counter()
    if not ideal.feasible:
        raise RuntimeError(f"the keep-all plan with no memory limit is infeasible: {ideal.infeasible_reason}")
    analytic_peak = analytic = None
    if inputs.torch_spec is not None:
        analytic = build_graph(analytic_twin(inputs.model, inputs.torch_spec), inputs.hardware, inputs.training)
        analytic_peak = int(simulate_ideal(analytic, inputs.hardware).peak_activation_bytes)
    _BASELINES[key] = Baseline(graph, ideal, t1 - t0, t2 - t1, analytic_peak, analytic)
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
    """Run the stages and write profile.csv, graph.json, plan.json, metrics.json, trace.json, and
    timeline.png unless the plots level leaves it out.

    `timings` is filled as each stage finishes, so a job that fails midway still reports where its
    time went.
    """
    from slackswap.graph_io import write_graph_json
    from slackswap.memory.static import capacity_reason
    from slackswap.node import pinned_reason
    from slackswap.plan_io import write_plan_json
    from slackswap.planners.registry import get_planner
    from slackswap.profile.report import write_profile_csv
    from slackswap.simulate.fit import plan_and_simulate
    from slackswap.simulate.metrics import compute_metrics, unsimulated_metrics
    from slackswap.simulate.trace import write_trace_json

    base, hit = baseline(inputs, resolved)
    timings["profile_s"] = 0.0 if hit else base.profile_wall_s
    timings["ideal_sim_s"] = 0.0 if hit else base.ideal_sim_wall_s
    graph, ideal = base.graph, base.ideal

    t0 = time.perf_counter()
    _write_profile_files(
        _baseline_key(resolved),
        run_dir,
        lambda path: write_profile_csv(graph, path, reference=base.analytic_graph),
        lambda path: write_graph_json(graph, path),
    )
    timings["write_profile_s"] = time.perf_counter() - t0

    keep_all_peak_bytes = int(ideal.peak_activation_bytes)
    capacity = device_capacity(inputs)
    if inputs.budget.device and not capacity.fits:
        # Static memory alone fills the device: a result (infeasible), reported term by term.
        reason = capacity_reason(capacity, _suggest_shards(inputs))
        metrics = run_metrics(inputs, base, capacity, unsimulated_metrics(ideal, None, reason))
        _write_json(run_dir / "metrics.json", metrics)
        return Outcome(RunStatus.INFEASIBLE, f"device memory: {reason}", metrics, timings)
    budget_bytes = inputs.budget.resolve_bytes(keep_all_peak_bytes, capacity.activation_capacity_bytes)
    planner = get_planner(inputs.planner_name, **inputs.planner_options)

    t0 = time.perf_counter()
    try:
        fitted = plan_and_simulate(
            planner,
            graph,
            inputs.hardware,
            budget_bytes,
            allocator=inputs.allocator == "caching",
            plan_against=inputs.plan_against,
            margin_fraction=inputs.plan_margin_fraction,
        )
    except InfeasibleBudgetError as exc:
        timings["plan_s"] = plan_wall_s = time.perf_counter() - t0
        # No plan, so nothing to simulate: what a simulation would give is None.
        simulation = unsimulated_metrics(
            ideal, budget_bytes, exc.reason, min_feasible_bytes=exc.min_feasible_bytes, plan_wall_s=plan_wall_s
        )
        metrics = run_metrics(inputs, base, capacity, simulation)
        _write_json(run_dir / "metrics.json", metrics)
        return Outcome(RunStatus.INFEASIBLE, f"planner: {exc.reason}", metrics, timings)
    plan, result = fitted.plan, fitted.result
    timings["plan_s"] = plan_wall_s = fitted.plan_wall_s
    timings["sim_s"] = sim_wall_s = fitted.sim_wall_s
    write_plan_json(plan, run_dir / "plan.json")

    simulation = compute_metrics(result, ideal, plan_wall_s=plan_wall_s, sim_wall_s=sim_wall_s)
    metrics = run_metrics(inputs, base, capacity, simulation, fitted)
    if inputs.alone_hardware is not None:
        metrics["alone_throughput_ratio"] = _alone_throughput(inputs, planner, graph, ideal, budget_bytes)
    t0 = time.perf_counter()
    _write_json(run_dir / "metrics.json", metrics)
    write_trace_json(result, run_dir / "trace.json")
    timings["write_results_s"] = time.perf_counter() - t0
    if inputs.draw_timeline:
        from pipelines.imports import import_paused
        from slackswap.simulate.timeline import write_timeline_png

        t0 = time.perf_counter()
        import_paused("matplotlib.figure")  # what write_timeline_png draws with
        import_paused("matplotlib.backends.backend_agg")
        title = timeline_title(inputs, budget_bytes, keep_all_peak_bytes)
        write_timeline_png(result, run_dir / "timeline.png", budget_bytes, title=title)
        timings["write_timeline_s"] = time.perf_counter() - t0

    facts = {"swapped": plan.tensors_with(Decision.SWAP), "recomputed": plan.tensors_with(Decision.RECOMPUTE)}
    pinned = None if inputs.node is None else pinned_reason(inputs.node, int(metrics.get("d2h_bytes") or 0))
    if result.feasible and pinned is not None:
        # Every rank of the node holds the same swapped bytes in pinned host memory: over it, infeasible.
        metrics["feasible"] = False
        _write_json(run_dir / "metrics.json", metrics)
        return Outcome(RunStatus.INFEASIBLE, pinned, metrics, timings, facts)
    if result.feasible:
        return Outcome(RunStatus.OK, "", metrics, timings, facts)
    return Outcome(RunStatus.INFEASIBLE, f"simulator: {result.infeasible_reason}", metrics, timings, facts)


def _alone_throughput(inputs: Inputs, planner: Any, graph: Any, ideal: Any, budget_bytes: int) -> float | None:
    """Throughput retained by the same planner and budget with the GPU alone on its link (None if
    infeasible there): the reference that shows what the node's sharing cost this planner."""
    from slackswap.simulate.fit import plan_and_simulate
    from slackswap.simulate.metrics import compute_metrics

    try:
        alone = plan_and_simulate(
            planner, graph, inputs.alone_hardware, budget_bytes, allocator=inputs.allocator == "caching",
            plan_against=inputs.plan_against, margin_fraction=inputs.plan_margin_fraction,
        )
    except InfeasibleBudgetError:
        return None
    metrics = compute_metrics(alone.result, ideal, plan_wall_s=alone.plan_wall_s, sim_wall_s=alone.sim_wall_s)
    return metrics["throughput_ratio"] if alone.result.feasible else None


#: The bytes of profile.csv and graph.json per baseline key: every job of a workload writes the same
#: two files, so they are serialised once per process and copied after that.
_PROFILE_FILES: dict[str, tuple[bytes, bytes]] = {}


def _write_profile_files(key: str, run_dir: Path, write_csv: Any, write_json: Any) -> None:
    cached = _PROFILE_FILES.get(key)
    if cached is None:
        write_csv(run_dir / "profile.csv")
        write_json(run_dir / "graph.json")
        _PROFILE_FILES[key] = ((run_dir / "profile.csv").read_bytes(), (run_dir / "graph.json").read_bytes())
        return
    (run_dir / "profile.csv").write_bytes(cached[0])
    (run_dir / "graph.json").write_bytes(cached[1])


def device_capacity(inputs: Inputs) -> Any:
    """Device memory - reserve - static training state per GPU (`slackswap.memory.static`)."""
    from slackswap.memory.static import DeviceCapacity, static_memory
    from slackswap.profile import parameter_counts

    static = static_memory(*parameter_counts(inputs.model), inputs.training, inputs.model.dtype)
    return DeviceCapacity(inputs.hardware.device_memory_bytes, inputs.budget.reserve_bytes, static)


def _suggest_shards(inputs: Inputs) -> tuple[int, int] | None:
    from slackswap.memory.static import smallest_fitting_shards
    from slackswap.profile import parameter_counts

    return smallest_fitting_shards(
        *parameter_counts(inputs.model),
        inputs.training,
        inputs.model.dtype,
        inputs.hardware.device_memory_bytes,
        inputs.budget.reserve_bytes,
    )


def run_metrics(
    inputs: Inputs, base: Baseline, capacity: Any, simulation: Mapping[str, Any], fitted: Any = None
) -> dict[str, Any]:
    """metrics.json, built here only, with one key set for every outcome of one config (ok, planner
    infeasible, device infeasible): the simulation's keys (`slackswap.simulate.metrics`), the device's
    static split, the allocator replay's keys when the allocator is modelled, the planning budget, and
    the real-vs-analytic peaks when the graph is traced. What an outcome did not compute is None.

    `fitted` is the `slackswap.simulate.fit` result of a planned and simulated run; None when no plan
    was made.
    """
    from slackswap.memory.replay import AllocatorReport

    report = None if fitted is None else fitted.report
    metrics = dict(simulation) | _static_metrics(capacity)
    if inputs.allocator == "caching":
        metrics |= dict.fromkeys(AllocatorReport.METRIC_KEYS) if report is None else report.metrics()
    # What the device has left at this run's peak (reserved peak when the allocator is modelled); with
    # no plan, all of the activation capacity.
    peak = simulation["peak_activation_bytes"] if report is None else report.peak_reserved_bytes
    metrics["headroom_bytes"] = capacity.activation_capacity_bytes - (peak or 0)
    metrics["planning_budget_bytes"] = None if fitted is None else fitted.planning_budget_bytes
    metrics["planning_rounds"] = None if fitted is None else fitted.rounds
    metrics |= _source_metrics(base)
    metrics |= _node_metrics(inputs, simulation)
    return metrics


def _node_metrics(inputs: Inputs, simulation: Mapping[str, Any]) -> dict[str, Any]:
    """The node's share of the host link each GPU got and the pinned host bytes the node's ranks need."""
    if inputs.node is None:
        return {}
    swapped = simulation.get("d2h_bytes")
    return inputs.shared_link.metrics() | {
        "node": inputs.node.name,
        "gpus_per_node": inputs.node.gpus_per_node,
        "pinned_host_bytes": inputs.node.pinned_host_bytes,
        "pinned_needed_bytes": None if swapped is None else swapped * inputs.node.gpus_per_node,
        # set by `execute` once the plan is also simulated with the GPU alone (a node that shares)
        "alone_throughput_ratio": None,
    }


def _static_metrics(capacity: Any) -> dict[str, Any]:
    """Static bytes per GPU by term, and the device's split: reported by every run, whatever the budget."""
    static = capacity.static
    return {
        "static_bytes": static.total_bytes,
        **{f"static_{name}": value for name, value in static.terms().items()},
        "num_params": static.num_params,
        "device_memory_bytes": capacity.device_memory_bytes,
        "reserve_bytes": capacity.reserve_bytes,
        "activation_capacity_bytes": capacity.activation_capacity_bytes,
    }


def _source_metrics(base: Baseline) -> dict[str, Any]:
    """A traced graph's keep-all peak against the analytic graph's of the same shape (no keys if analytic)."""
    if base.analytic_peak_bytes is None:
        return {}
    peak = int(base.ideal.peak_activation_bytes)
    return {"analytic_keep_all_peak_bytes": base.analytic_peak_bytes,
            "real_to_analytic_peak_ratio": peak / base.analytic_peak_bytes}


def timeline_title(inputs: Inputs, budget_bytes: int, keep_all_peak_bytes: int) -> str:
    """Model, hardware, planner and budget, the four things that make one timeline differ from another."""
    share = budget_bytes / keep_all_peak_bytes if keep_all_peak_bytes else float("nan")
    return (
        f"{inputs.model.name} on {inputs.hardware.name}, planner {inputs.planner_name}, "
        f"budget {budget_bytes / 2**30:.3g} GiB ({share:.0%} of the keep-all peak)"
    )


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(dict(data), indent=2, sort_keys=True) + "\n")
