"""One Hydra job: resolve and validate the config, run the stages, record the outcome everywhere.

Outcomes (`pipelines.records.RunStatus`), and where each is recorded (run_record.json, a
`pipelines.records.RunRecord`, in the run dir; MLflow run; stdout):
- `ok`: the plan fits the budget.
- `infeasible`: the planner raised `InfeasibleBudgetError` or the simulator found the plan does not
  fit; the reason names tensor/op/bytes. The job returns normally: an infeasible budget is a result.
- `failed`: any other exception. In a multirun it is recorded and the job returns, so the rest of the
  sweep still runs and is aggregated; a single run re-raises after recording, so the exit code is 1.

Bad config values raise `ConfigError` before the MLflow run starts (single run); in a multirun they
are recorded as `failed` without doing any work.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipelines import presentation, stages, tracking
from pipelines.presentation import gib
from pipelines.records import RECORD_FILE, RunRecord, RunStatus
from slackswap.errors import ConfigError

PARENT_FILE = "mlflow_parent.json"
RESOLVED_CONFIG_FILE = "config.resolved.yaml"
TRACEBACK_FILE = "traceback.txt"
#: MLflow tag values are limited in length; the full reason is always in run_record.json.
MAX_TAG_CHARS = 4000


@dataclass(frozen=True)
class JobContext:
    run_dir: Path
    multirun: bool
    sweep_dir: Path | None
    choices: Mapping[str, str]

    @classmethod
    def from_hydra(cls) -> JobContext:
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        choices = {k: str(v) for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and v is not None}
        return cls(
            run_dir=Path(hc.runtime.output_dir),
            multirun=multirun,
            sweep_dir=Path(hc.sweep.dir) if multirun else None,
            choices=choices,
        )


def read_parent(sweep_dir: Path) -> dict[str, Any]:
    path = sweep_dir / PARENT_FILE
    if not path.is_file():
        raise RuntimeError(
            f"{path} is missing: the SweepCallback (hydra.callbacks.slackswap_sweep) did not create the MLflow "
            "parent run before the jobs started; see the warnings above"
        )
    return json.loads(path.read_text())


def run_job(cfg: DictConfig) -> RunRecord:
    t_start = time.perf_counter()
    ctx = JobContext.from_hydra()
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    (ctx.run_dir / RESOLVED_CONFIG_FILE).write_text(OmegaConf.to_yaml(resolved))
    track = resolved["tracking"]
    parent = read_parent(ctx.sweep_dir) if ctx.multirun and track["enabled"] else None
    # Planner first, then only what varies in the sweep (all four parts for a single run).
    name = presentation.run_name(parent.get("varying") if parent else None, ctx.choices, resolved)
    record = RunRecord(
        run_name=name,
        choices=dict(ctx.choices),
        model=ctx.choices.get("model"),
        hardware=ctx.choices.get("hardware"),
        planner=_planner_label(ctx.choices.get("planner"), resolved["planner"]["name"]),
        planner_name=resolved["planner"]["name"],
        budget_fraction=resolved["budget"]["fraction"],
        budget_bytes_requested=resolved["budget"]["bytes"],
        run_dir=str(ctx.run_dir),
    )
    timings = record.timings_s

    config_error: ConfigError | None = None
    try:
        inputs = stages.validate_inputs(resolved, ctx.multirun)
    except ConfigError as exc:
        if not ctx.multirun:
            raise
        config_error = exc

    client = run_id = None
    artifact_root = track["artifact_location"]
    if track["enabled"]:
        t0 = time.perf_counter()
        flat = presentation.config_params(tracking.flatten_params(resolved))
        if parent is not None:
            client = tracking.open_client(parent["tracking_uri"])
            experiment_id, parent_run_id = parent["experiment_id"], parent["run_id"]
            artifact_root = parent.get("artifact_root", artifact_root)
            # Constants go to the parent at the end of the sweep (callbacks.SweepCallback): a child
            # carries the filter keys and what its sweep varies.
            params = presentation.filter_params(ctx.choices, record.planner, resolved)
            params |= presentation.swept_value_params(parent.get("varying", ()), flat)
        else:
            client = tracking.open_client(track["uri"])
            experiment_id = tracking.ensure_experiment(client, track["experiment"], track["artifact_location"])
            parent_run_id = None
            params = presentation.filter_params(ctx.choices, record.planner, resolved) | flat
        run_id = tracking.start_run(client, experiment_id, name, _choice_tags(ctx.choices), parent_run_id)
        tracking.log_params(client, run_id, params)
        tracking.log_presets(
            client,
            run_id,
            {g: (ctx.choices.get(g, resolved[g]["name"]), resolved[g]) for g in ("model", "hardware")},
        )
        record = replace(record, mlflow_run_id=run_id)
        timings["mlflow_start_s"] = time.perf_counter() - t0

    error: BaseException | None = None
    if config_error is not None:
        record = replace(record, status=RunStatus.FAILED, failure_reason=f"ConfigError: {config_error}")
    else:
        try:
            outcome = stages.execute(inputs, resolved, ctx.run_dir, timings)
            record = replace(record, status=outcome.status, failure_reason=outcome.failure_reason,
                             metrics=outcome.metrics, facts=outcome.facts)
        except Exception as exc:  # recorded below; re-raised for a single run
            error = exc
            record = replace(record, status=RunStatus.FAILED, failure_reason=f"{type(exc).__name__}: {exc}")
            (ctx.run_dir / TRACEBACK_FILE).write_text(traceback.format_exc())

    record.write(ctx.run_dir)
    if client is not None:
        t0 = time.perf_counter()
        try:
            tracking.log_metrics(client, run_id, presentation.with_units(record.metrics))
            tags = {
                "status": record.status,
                tracking.NOTE_TAG: presentation.child_description(record.to_dict(), resolved),
            }
            if record.failure_reason:
                tags["reason"] = _clip(record.failure_reason)
            tracking.log_tags(client, run_id, tags)
            tracking.store_artifacts(client, run_id, ctx.run_dir, artifact_root)
        finally:
            tracking.end_run(client, run_id, record.status)
        timings["mlflow_log_s"] = time.perf_counter() - t0
    timings["job_total_s"] = time.perf_counter() - t_start
    # Rewrite with the final timings (the copy logged to MLflow lacks only the logging time itself).
    record.write(ctx.run_dir)

    print(format_summary(record, resolved) if not ctx.multirun else format_one_line(record))
    if error is not None and not ctx.multirun:
        raise error
    return record


def _planner_label(choice: str | None, name: str) -> str:
    return name if choice in (None, name) else f"{choice}[{name}]"


def _choice_tags(choices: Mapping[str, str]) -> dict[str, str]:
    return {f"choice.{group}": value for group, value in choices.items()} | {"status": "running"}


def _clip(text: str) -> str:
    if len(text) <= MAX_TAG_CHARS:
        return text
    return text[:MAX_TAG_CHARS] + f" ... [truncated; full text in {RECORD_FILE}]"


def format_one_line(record: RunRecord) -> str:
    m = record.metrics
    ratio = m.get("throughput_ratio")
    shown = f"{ratio:.1%}" if isinstance(ratio, (int, float)) else "n/a"
    tail = f"  ({record.failure_reason})" if record.failure_reason else ""
    return f"[{record.status!s:>10}] {record.run_name}: throughput retained {shown}{tail}"


def format_summary(record: RunRecord, resolved: Mapping[str, Any]) -> str:
    m = record.metrics
    facts = record.facts
    ratio = m.get("throughput_ratio")
    lines = [
        f"model        {record.model} ({resolved['model']['name']})",
        f"hardware     {record.hardware} ({resolved['hardware']['name']}, "
        f"link {resolved['hardware']['link']['name']})",
        f"budget       {gib(m.get('budget_bytes'))} "
        f"(fraction={resolved['budget']['fraction']}, bytes={resolved['budget']['bytes']}) "
        f"of keep-all peak {gib(m.get('keep_all_peak_bytes'))}",
        f"planner      {record.planner} ({record.planner_name})",
        f"status       {record.status!s}" + (f": {record.failure_reason}" if record.failure_reason else ""),
    ]
    if ratio is not None:
        lines += [
            f"throughput   {ratio:.2%} of ideal",
            f"step time    {m.get('step_s', float('nan')):.4f} s (ideal {m.get('ideal_step_s', float('nan')):.4f} s)",
            f"peak memory  {gib(m.get('peak_activation_bytes'))} of budget {gib(m.get('budget_bytes'))}",
            f"swapped      {m.get('swapped_tensors')} tensors, {gib(m.get('d2h_bytes'))} d2h, "
            f"{gib(m.get('h2d_bytes'))} h2d, stall {m.get('stall_s', float('nan')):.4f} s",
            f"recomputed   {m.get('recomputed_tensors')} tensors, "
            f"{m.get('recompute_s', float('nan')):.4f} s extra compute",
        ]
        for key in ("swapped", "recomputed"):
            names = facts.get(key) or ()
            if names:
                shown = ", ".join(names[:6]) + (f", ... (+{len(names) - 6})" if len(names) > 6 else "")
                lines.append(f"  {key}: {shown}")
    lines.append(f"run dir      {record.run_dir}")
    if record.mlflow_run_id:
        lines.append(f"mlflow run   {record.mlflow_run_id} ({resolved['tracking']['uri']})")
    return "\n".join(lines)
