"""`python -m pipelines.run +experiment=seed_identify`: the shared-assumption grid as one tracked run.

Thin wiring around `slackswap.experiment.identify`: validate every value first (a bad knob fails naming it, exit 2,
before anything is recorded), evaluate the grid in-process, write identify_grid.csv,
identify_summary.md and identify.json into the run directory, and log one MLflow run (params: the
knob ranges; metrics: settings evaluated, matches, best error; artifacts: the three files).
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipelines import faults, tracking
from pipelines.records import RunStatus
from slackswap.errors import ConfigError
from slackswap.experiment import identify
from slackswap.experiment.spec import hardware_from_config
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ModelConfig

FILES = ("identify_summary.md", "identify_grid.csv", "identify.json")


def problem_from(resolved: Mapping[str, Any]) -> identify.Problem:
    node = resolved["identify"]
    if not node["models"]:
        raise ConfigError("identify.models", {}, "names no workload")
    workloads = {}
    for key, model in node["models"].items():
        model = dict(model)
        if model.pop("torch", None) is not None:
            raise ConfigError(f"identify.models.{key}.torch", "...", "the grid runs on analytic graphs only")
        workloads[key] = ModelConfig.from_dict(model)
    hardware, _, _ = hardware_from_config(resolved)
    return identify.Problem(
        workloads=workloads,
        reference=dict(node["reference"]),
        hardware=hardware,
        training=TrainingConfig.from_dict(resolved.get("training") or {}),
        budget_fraction=node["budget_fraction"],
        planner=node["planner"],
    )


def _check(node: Mapping[str, Any], problem: identify.Problem) -> None:
    """Every knob value, before any work: building the grids constructs (validates) every setting."""
    for name in ("tolerance_pp", "refine_within_pp"):
        value = node[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"identify.{name}", value, "must be a positive number")
    workers = node["workers"]
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError("identify.workers", workers, "must be an integer >= 1")
    if not isinstance(node["bound_points"], int) or node["bound_points"] < 0:
        raise ConfigError("identify.bound_points", node["bound_points"], "must be an integer >= 0")
    for s in identify.grid(node["coarse"]):
        s.hardware(problem.hardware)  # a link above the theoretical bandwidth names identify.link_gbps
    fine = dict(node["fine"])
    scales = fine.pop("matmul_scale", None)
    if not scales or any(isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0 for x in scales):
        raise ConfigError("identify.fine.matmul_scale", scales, "must list positive factors")
    for s in identify.grid({"attention": ["eager"], "dropout": [False], "matmul_efficiency": [0.5], **fine}):
        s.hardware(problem.hardware)
    from slackswap.planners.registry import get_planner

    get_planner(problem.planner)
    get_planner(node["bound_planner"])


def _pct(value: float | None) -> str:
    return "infeasible" if value is None else f"{value * 100:.2f}"


def summary_markdown(node: Mapping[str, Any], result: identify.Search, hits: Sequence[identify.Point],
                     best: Sequence[tuple[identify.Point, Mapping[str, float | None]]],
                     pins: Mapping[str, Any], scale: Mapping[float, float], wall_s: float) -> str:
    ref = node["reference"]
    names = list(ref)
    lines = [
        "# What the seed assumed: one shared setting for all three workloads",
        "",
        f"{len(result.points)} settings evaluated ({len(result.coarse)} coarse, {len(result.refined)} refined; "
        f"{len(result.points) * len(names)} plan+simulate runs) in {wall_s:.0f} s. Reference: "
        + ", ".join(f"{k} {ref[k] * 100:.1f} %" for k in names)
        + f"; a match is within {node['tolerance_pp']} pp of every figure.",
        "",
        "## Knobs and their plausible ranges",
        "",
        *[f"- **{k}**: {v}" for k, v in node["ranges"].items()],
        "",
        f"Refined (coarse best within {node['refine_within_pp']} pp): "
        + (", ".join(f"{a}, dropout {'on' if d else 'off'}" for a, d in result.refined_combos) or "none"),
        "",
        f"## Best settings ({len(hits)} of {len(result.points)} match)",
        "",
        "| setting | " + " | ".join(names) + " | max error (pp) | milp gap |",
        "|---" * (len(names) + 3) + "|",
    ]
    for point, gaps in best:
        gap = ", ".join(f"{k} {'-' if g is None else f'+{g:.2%}'}" for k, g in gaps.items()) if gaps else "-"
        lines.append(f"| {point.setting.label()} | " + " | ".join(_pct(point.retained[k]) for k in names)
                     + f" | {point.error_pp(ref):.2f} | {gap} |")
    lines += ["", "## What the figures pin down", ""]
    if not pins:
        lines.append("No setting matched: nothing is pinned; the best settings above are the closest.")
    for name, span in pins.items():
        lines.append(f"- {name}: matches {span['matches']} of searched {span['searched']}")
    if scale:
        lines += ["", "Time-scale check at the best setting (every speed knob times a factor): largest change "
                  + ", ".join(f"x{f:g}: {d:.2f} pp" for f, d in scale.items())
                  + " (near 0: the figures fix ratios, not absolute speeds)."]
    return "\n".join(lines) + "\n"


def _write(run_dir: Path, node: Mapping[str, Any], result: identify.Search, hits: Sequence[identify.Point],
           best: Sequence[tuple[identify.Point, Mapping[str, float | None]]], pins: Mapping[str, Any],
           scale: Mapping[float, float], wall_s: float) -> str:
    ref = node["reference"]
    names = list(ref)
    with (run_dir / "identify_grid.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["stage", "attention", "dropout", "matmul_efficiency", "hbm_efficiency", "link_gbps",
                         *names, "max_error_pp"])
        for stage, points in (("coarse", result.coarse), ("refined", result.refined)):
            for p in points:
                s = p.setting
                err = p.error_pp(ref)
                writer.writerow([stage, s.attention, s.dropout, s.matmul_efficiency, s.hbm_efficiency, s.link_gbps,
                                 *(None if p.retained[k] is None else round(p.retained[k], 6) for k in names),
                                 None if math.isinf(err) else round(err, 4)])
    summary = summary_markdown(node, result, hits, best, pins, scale, wall_s)
    (run_dir / "identify_summary.md").write_text(summary)
    data = {
        "settings_evaluated": len(result.points),
        "wall_s": wall_s,
        "matches": [{"setting": vars(p.setting), "retained": dict(p.retained), "max_error_pp": p.error_pp(ref)}
                    for p in hits],
        "best": [{"setting": vars(p.setting), "retained": dict(p.retained), "max_error_pp": p.error_pp(ref),
                  "bound_gap": dict(g)} for p, g in best],
        "pinned": pins,
        "scale_check_pp": {str(k): v for k, v in scale.items()},
    }
    (run_dir / "identify.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    return summary


class Progress:
    """The grid's console lines as it goes, as a sweep's `[i/N 12.3 s]` (pipelines/progress.py): the
    seed grid is one run of minutes (80 s idle on 2 cores, much longer loaded) and said nothing."""

    def __init__(self, t0: float, reference: Mapping[str, float]) -> None:
        self.t0 = t0
        self.reference = reference

    def line(self, where: str, what: str) -> None:
        print(f"[{where} {time.perf_counter() - self.t0:6.1f} s] {what}", flush=True)

    def point(self, stage: str, i: int, n: int, point: identify.Point) -> None:
        err = point.error_pp(self.reference)
        shown = ", ".join(f"{k} {_pct(point.retained[k])}" for k in self.reference)
        self.line(f"{stage} {i}/{n}", f"{point.setting.label()}: {shown}; max error "
                  + ("infeasible" if math.isinf(err) else f"{err:.2f} pp"))


def run_identify(cfg: DictConfig) -> dict[str, Any]:
    from pipelines.job import resolve_config

    resolved = resolve_config(cfg)
    node = resolved["identify"]
    problem = problem_from(resolved)
    _check(node, problem)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    faults.note_output_dir(run_dir)
    track = resolved["tracking"]
    client = run_id = artifact_uri = None
    if track["enabled"]:
        client = tracking.open_client(track["uri"])
        experiment_id = tracking.ensure_experiment(client, track["experiment"], track.get("artifact_location"))
        info = tracking.create_run(client, experiment_id, "seed_identify", {"slackswap.kind": "identify"}, None)
        run_id, artifact_uri = info.run_id, info.artifact_uri
        faults.track_in_flight(client, run_id)
        tracking.log_params(client, run_id, tracking.flatten_params(
            {k: node[k] for k in ("reference", "tolerance_pp", "budget_fraction", "planner", "coarse", "fine",
                                  "refine_within_pp")} | {"hardware": resolved["hardware"]["name"],
                                                          "node": resolved["node"]["name"]}))
    try:
        t0 = time.perf_counter()
        say = Progress(t0, problem.reference)
        result = identify.search(problem, node["coarse"], node["fine"], node["refine_within_pp"], node["workers"],
                                 on_point=say.point)
        ref = problem.reference
        hits = identify.matches(result.points, ref, node["tolerance_pp"])
        ranked = hits or sorted(result.points, key=lambda p: p.error_pp(ref))
        best = []
        for i, p in enumerate(ranked[: node["bound_points"]], start=1):
            say.line(f"bound {i}/{min(len(ranked), node['bound_points'])}",
                     f"{node['bound_planner']} at {p.setting.label()}")
            best.append((p, identify.bound_gaps(problem, p, node["bound_planner"])))
        pins = identify.pinned(hits, result.points)
        if ranked:
            say.line("scale check", f"every speed knob x0.8 and x1.2 at {ranked[0].setting.label()}")
        scale = identify.scale_check(problem, ranked[0]) if ranked else {}
        wall_s = time.perf_counter() - t0
        summary = _write(run_dir, node, result, hits, best, pins, scale, wall_s)
        print(summary)
        print(f"files: {', '.join(str(run_dir / f) for f in FILES)}")
        if client is not None:
            tracking.log_metrics(client, run_id, {
                "settings_evaluated": len(result.points), "matches": len(hits), "wall_s": wall_s,
                "best_error_pp": ranked[0].error_pp(ref) if ranked else None,
            })
            tracking.store_artifacts(client, run_id, [run_dir / f for f in FILES], track.get("artifact_location"),
                                     artifact_uri)
    except faults.Interrupted:
        raise  # the run stays in flight: the interrupt handler marks it KILLED
    except BaseException:
        if client is not None:
            tracking.end_run(client, run_id, RunStatus.FAILED)
            faults.done_in_flight(run_id)
        raise
    if client is not None:
        tracking.end_run(client, run_id, RunStatus.OK)
        faults.done_in_flight(run_id)
    return {"matches": len(hits), "settings_evaluated": len(result.points)}
