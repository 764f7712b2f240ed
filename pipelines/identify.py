"""`python -m pipelines.run +experiment=seed_identify`: the shared-assumption grid as one tracked run.

Thin wiring around `slackswap.experiment.identify_spec`: build the spec from the resolved config (every
value checked there; a bad knob fails naming it, exit 2, before anything is recorded), run the study
in-process with its progress printed, write identify_grid.csv, identify_summary.md and identify.json
into the run directory, and log one MLflow run (params: the knob ranges; metrics: settings evaluated,
matches, best error; artifacts: the three files).
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipelines import faults, tracking
from pipelines.records import RunStatus
from slackswap.experiment import identify
from slackswap.experiment.identify_spec import IdentifyOutcome, IdentifyProgress, IdentifySpec, run_study

FILES = ("identify_summary.md", "identify_grid.csv", "identify.json")


def _pct(value: float | None) -> str:
    return "infeasible" if value is None else f"{value * 100:.2f}"


def summary_markdown(spec: IdentifySpec, outcome: IdentifyOutcome) -> str:
    ref = spec.problem.reference
    names = list(ref)
    result, hits = outcome.search, outcome.hits
    lines = [
        "# What the seed assumed: one shared setting for all three workloads",
        "",
        f"{len(result.points)} settings evaluated ({len(result.coarse)} coarse, {len(result.refined)} refined; "
        f"{len(result.points) * len(names)} plan+simulate runs) in {outcome.wall_s:.0f} s. Reference: "
        + ", ".join(f"{k} {ref[k] * 100:.1f} %" for k in names)
        + f"; a match is within {spec.tolerance_pp} pp of every figure.",
        "",
        "## Knobs and their plausible ranges",
        "",
        *[f"- **{k}**: {v}" for k, v in spec.ranges.items()],
        "",
        f"Refined (coarse best within {spec.refine_within_pp} pp): "
        + (", ".join(f"{a}, dropout {'on' if d else 'off'}" for a, d in result.refined_combos) or "none"),
        "",
        f"## Best settings ({len(hits)} of {len(result.points)} match)",
        "",
        "| setting | " + " | ".join(names) + " | max error (pp) | milp gap |",
        "|---" * (len(names) + 3) + "|",
    ]
    for point, gaps in outcome.best:
        gap = ", ".join(f"{k} {'-' if g is None else f'+{g:.2%}'}" for k, g in gaps.items()) if gaps else "-"
        lines.append(f"| {point.setting.label()} | " + " | ".join(_pct(point.retained[k]) for k in names)
                     + f" | {point.error_pp(ref):.2f} | {gap} |")
    lines += ["", "## What the figures pin down", ""]
    if not outcome.pins:
        lines.append("No setting matched: nothing is pinned; the best settings above are the closest.")
    for name, span in outcome.pins.items():
        lines.append(f"- {name}: matches {span['matches']} of searched {span['searched']}")
    if outcome.scale:
        lines += ["", "Time-scale check at the best setting (every speed knob times a factor): largest change "
                  + ", ".join(f"x{f:g}: {d:.2f} pp" for f, d in outcome.scale.items())
                  + " (near 0: the figures fix ratios, not absolute speeds)."]
    return "\n".join(lines) + "\n"


def _write(run_dir: Path, spec: IdentifySpec, outcome: IdentifyOutcome) -> str:
    ref = spec.problem.reference
    names = list(ref)
    result = outcome.search
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
    summary = summary_markdown(spec, outcome)
    (run_dir / "identify_summary.md").write_text(summary)
    data = {
        "settings_evaluated": len(result.points),
        "wall_s": outcome.wall_s,
        "matches": [{"setting": vars(p.setting), "retained": dict(p.retained), "max_error_pp": p.error_pp(ref)}
                    for p in outcome.hits],
        "best": [{"setting": vars(p.setting), "retained": dict(p.retained), "max_error_pp": p.error_pp(ref),
                  "bound_gap": dict(g)} for p, g in outcome.best],
        "pinned": outcome.pins,
        "scale_check_pp": {str(k): v for k, v in outcome.scale.items()},
    }
    (run_dir / "identify.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    return summary


class Progress(IdentifyProgress):
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

    def bound(self, i: int, n: int, point: identify.Point, planner: str) -> None:
        self.line(f"bound {i}/{n}", f"{planner} at {point.setting.label()}")

    def scale_check(self, point: identify.Point) -> None:
        self.line("scale check", f"every speed knob x0.8 and x1.2 at {point.setting.label()}")


def run_identify(cfg: DictConfig) -> dict[str, Any]:
    from pipelines.job import resolve_config

    resolved = resolve_config(cfg)
    node = resolved["identify"]
    spec = IdentifySpec.from_dict(resolved)
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
        outcome = run_study(spec, Progress(time.perf_counter(), spec.problem.reference))
        summary = _write(run_dir, spec, outcome)
        print(summary)
        print(f"files: {', '.join(str(run_dir / f) for f in FILES)}")
        if client is not None:
            tracking.log_metrics(client, run_id, {
                "settings_evaluated": len(outcome.search.points), "matches": len(outcome.hits),
                "wall_s": outcome.wall_s, "best_error_pp": outcome.best_error_pp,
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
    return {"matches": len(outcome.hits), "settings_evaluated": len(outcome.search.points)}
