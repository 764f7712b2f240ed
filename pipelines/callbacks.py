"""Hydra callback that brackets a sweep: MLflow parent run before the jobs, aggregation after.

Why here: `on_multirun_start` runs once in the launching process before any worker exists. Creating
the SQLite schema and the experiment there means parallel workers (joblib, submitit) never race to
create them ("table experiments already exists"). The parent run id is handed to the jobs through a
file in the sweep directory, which every launcher's workers can read (same machine or shared
filesystem) and which, unlike an environment variable, cannot leak into a later run in the same process.

Hydra turns exceptions raised in callbacks into a UserWarning, so failures here are also logged as
errors; a missing parent file makes every job fail loudly (see `pipelines.job.read_parent`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipelines import faults, presentation, superseded, tracking
from pipelines.config_yaml import load_config
from pipelines.job import PARENT_FILE, RESOLVED_CONFIG_FILE
from pipelines.progress import read_progress
from pipelines.records import RunRecord, RunStatus
from pipelines.schemas import REPO_ROOT

log = logging.getLogger(__name__)


@dataclass
class SweepState:
    """The sweep this process launched: what an interrupt handler needs to close it."""

    sweep_dir: Path
    experiment: dict[str, Any]
    t_start: float
    parent: dict[str, str] | None = None
    status_counts: dict[str, int] = field(default_factory=dict)
    finished: bool = False
    #: The sweep's config, kept until `open_parent` opens the MLflow parent run.
    config: DictConfig | None = None
    #: Records of the jobs run in this process (basic launcher), by job folder: the summary has them
    #: even where a job's run_record.json could not be written (a full disk).
    records: dict[str, RunRecord] = field(default_factory=dict)
    #: Jobs without a record, records that cannot be read, summary files not written.
    missing: int = 0
    problems: tuple[str, ...] = ()
    #: The folders already in `<sweep dir>/superseded/` when this sweep run started.
    superseded_before: frozenset[str] = frozenset()


#: Set by on_multirun_start in the launching process; read by `pipelines.run` for the exit code and
#: by the interrupt handler.
ACTIVE_SWEEP: SweepState | None = None

#: `hydra/sweeper=slackswap` opens the parent itself once every job's config has composed.
PROGRESS_SWEEPER = "hydra_plugins.slackswap_sweeper.ProgressSweeper"


class SweepCallback(Callback):
    def __init__(self) -> None:
        self._t_start: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global ACTIVE_SWEEP
        try:
            self._t_start = time.perf_counter()
            HydraConfig.instance().set_config(config)  # ${hydra:...} is not set yet on hydra 1.3.8
            sweep_dir = Path(config.hydra.sweep.dir)
            ACTIVE_SWEEP = SweepState(
                sweep_dir, OmegaConf.to_container(config.experiment, resolve=True), self._t_start, config=config,
                superseded_before=frozenset(superseded.folders(sweep_dir)),
            )
            if OmegaConf.select(config, "hydra.sweeper._target_") != PROGRESS_SWEEPER:
                open_parent()  # another sweeper: before its check of the jobs' configs, as Hydra orders it
        except faults.Abort:
            raise
        except Exception:
            log.exception("SweepCallback.on_multirun_start failed: jobs cannot be tracked")
            raise

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """Keep a job's record in the launching process (basic launcher; in a worker there is no sweep
        state): the summary has it even when its file could not be written."""
        state = ACTIVE_SWEEP
        value = getattr(job_return, "_return_value", None)
        if state is not None and isinstance(value, RunRecord):
            state.records[Path(value.run_dir).name] = value

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if sys.exc_info()[0] is not None:
            # Hydra 1.4 calls this from a `finally`, also when the sweep is ending by an exception (a
            # config mistake before any job, an interrupt); Hydra 1.3 does not call it then. Those
            # endings are closed by `pipelines.faults` (one line, runs KILLED or FAILED), on both.
            return
        try:
            HydraConfig.instance().set_config(config)
            self._end_sweep(config)
        except Exception:
            log.exception("SweepCallback.on_multirun_end failed: the sweep was not aggregated")
            raise

    def _end_sweep(self, config: DictConfig) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        experiment = OmegaConf.to_container(config.experiment, resolve=True)
        from pipelines import aggregate  # pandas (~0.4 s to import) only when a sweep aggregates

        state = ACTIVE_SWEEP
        plots = OmegaConf.select(config, "plots", default="auto")
        known = state.records if state is not None else {}
        result = None
        try:
            result = aggregate.aggregate_sweep(sweep_dir, experiment, plots=plots != "none", known=known)
        except RuntimeError as exc:  # no record at all
            problems: tuple[str, ...] = (str(exc),)
            counts: dict[str, int] = {}
            missing = (read_progress_quietly(sweep_dir) or {}).get("total", 0)
        else:
            problems, counts, missing = result.problems, dict(result.status_counts), result.missing
            print(result.summary_md)
            if result.paper_table_md:
                print(result.paper_table_md)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        if state is not None:
            state.status_counts, state.missing, state.problems = counts, missing, problems
            state.finished = True
        set_aside = sorted(set(superseded.folders(sweep_dir)) - (state.superseded_before if state else set()))
        parent_file = sweep_dir / PARENT_FILE
        if not parent_file.is_file():
            if set_aside:
                print(superseded.line(sweep_dir, set_aside, None))
            return
        parent = json.loads(parent_file.read_text())
        client = tracking.open_client(parent["tracking_uri"])
        if set_aside:
            deleted = superseded.delete_children(client, parent, sweep_dir, set_aside)
            print(superseded.line(sweep_dir, set_aside, deleted))
        outcome, reason = sweep_outcome(counts, missing, problems)
        earlier_wall_s = _earlier_wall_s(client, parent["run_id"])
        tracking.log_metrics(
            client,
            parent["run_id"],
            {
                "jobs_total": sum(counts.values()),
                "jobs_missing": missing,
                **job_count_metrics(counts),
                # A re-run of the folder adds its time to the earlier runs'.
                "sweep_wall_s": earlier_wall_s + time.perf_counter() - self._t_start if self._t_start else None,
            },
        )
        if result is not None:
            tracking.backfill_bound_gaps(client, result.table)
            swept = place_params(client, parent["run_id"], sweep_dir, result.records)
            tracking.store_artifacts(client, parent["run_id"], list(result.files), parent.get("artifact_root"))
            link = f"#/experiments/{parent['experiment_id']}/runs/{parent['run_id']}/artifacts/" + (
                result.results_file if result.paper_table_md else "summary.md"
            )
            note = presentation.sweep_description(
                experiment, swept, parent_link=link, results_md=result.paper_table_md or result.summary_md,
                results_file=result.results_file,
            )
        else:
            note = presentation.sweep_description(experiment, {}) + f"\n\nNo summary: {reason}"
        tags = {tracking.NOTE_TAG: note, "status": str(outcome)}
        tags |= {"reason": reason} if reason else {}
        tracking.log_results(client, parent["run_id"], {}, tags)
        if "reason" not in tags:
            with contextlib.suppress(Exception):  # a re-run that completes clears the earlier reason
                client.delete_tag(parent["run_id"], "reason")
        tracking.set_experiment_description(client, parent["experiment_id"], note)
        tracking.end_run(client, parent["run_id"], outcome)
        faults.done_in_flight(parent["run_id"])
        print(ui_hint(parent))
        print(f"aggregate: {sweep_dir} (MLflow parent run {parent['run_id']} {tracking.MLFLOW_STATUS[outcome]})")


def read_progress_quietly(sweep_dir: Path) -> dict[str, Any] | None:
    try:
        return read_progress(sweep_dir)
    except (OSError, ValueError):
        return None


def sweep_outcome(counts: Mapping[str, int], missing: int, problems: Sequence[str]) -> tuple[RunStatus, str]:
    """The parent's outcome: ok when every job has a result (ok or infeasible) and the summary was
    written; else failed, with the reason in one line."""
    bad = counts.get(RunStatus.FAILED, 0) + counts.get(RunStatus.KILLED, 0)
    parts = []
    if bad:
        parts.append(f"{bad} of {sum(counts.values()) + missing} jobs failed or were killed")
    if missing:
        parts.append(f"{missing} job(s) have no record")
    parts += list(problems)
    return (RunStatus.FAILED if parts else RunStatus.OK), "; ".join(parts)


def _earlier_wall_s(client, run_id: str) -> float:
    """`sweep_wall_s` already logged on a reopened parent (0 for a new one)."""
    try:
        return float(client.get_run(run_id).data.metrics.get("sweep_wall_s", 0.0))
    except Exception:
        return 0.0


def open_parent() -> None:
    """Create the DB, the experiment and the sweep's MLflow parent run (or reopen the folder's), once,
    before any job runs; a no-op without a pending sweep or with tracking off."""
    state = ACTIVE_SWEEP
    if state is None or state.config is None:
        return
    config, state.config = state.config, None
    sweep_dir = state.sweep_dir
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        track = OmegaConf.to_container(config.tracking, resolve=True)
        if not track["enabled"]:
            return
        client = tracking.open_client(track["uri"])
        state.parent = _reopen_parent(client, track, sweep_dir)
        if state.parent is not None:
            return
        experiment_id = tracking.ensure_experiment(client, track["experiment"], track["artifact_location"])
        experiment = OmegaConf.to_container(config.experiment, resolve=True)
        params_node = OmegaConf.select(config, "hydra.sweeper.params")
        sweeper_params = OmegaConf.to_container(params_node, resolve=False) if params_node else {}
        task_overrides = list(config.hydra.overrides.task)
        varying = presentation.sweep_keys(task_overrides, sweeper_params)
        swept = _swept_text(varying, sweeper_params, task_overrides)
        note = presentation.sweep_description(experiment, swept)
        run_id = tracking.create_run(
            client,
            experiment_id,
            run_name=f"{experiment['name']}{presentation.SEPARATOR}{datetime.now():%Y-%m-%d %H:%M:%S}",
            tags={
                "sweep_dir": _portable_path(sweep_dir),
                "experiment_preset": str(experiment["name"]),
                "status": "running",
                tracking.NOTE_TAG: note,
            },
            parent_run_id=None,
        ).run_id
        faults.track_in_flight(client, run_id)
        tracking.set_experiment_description(client, experiment_id, note)
        tracking.log_params(client, run_id, {f"sweep.{key}": value for key, value in swept.items()})
        parent = {
            "run_id": run_id,
            "experiment_id": experiment_id,
            "tracking_uri": track["uri"],
            "artifact_root": track["artifact_location"],
            "varying": varying,
        }
        (sweep_dir / PARENT_FILE).write_text(json.dumps(parent, indent=2))
        state.parent = parent
        log.info("MLflow parent run %s in experiment %r (%s)", run_id, track["experiment"], track["uri"])
    except tracking.TrackingUnavailable as exc:
        # Before any job launches, once: every job would fail the same way.
        raise faults.Abort(f"error: {exc}") from None
    except OSError as exc:  # the sweep folder cannot be written (read-only, full)
        raise faults.Abort(f"error: {faults.os_error_line(exc)}") from None


def _portable_path(path: Path) -> str:
    """`path` relative to the repository when it lies inside it: no path of one machine in a tag."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else path.name


def _swept_text(varying: Sequence[str], sweeper_params: Mapping[str, Any], task: Sequence[str]) -> dict[str, str]:
    """{key: the sweep's value as written} for the description before any job ran."""
    written = {str(k): str(v) for k, v in sweeper_params.items()}
    for override in task:
        key, _, value = override.partition("=")
        written[key.lstrip("+~")] = value
    return {key: written.get(key, "?") for key in presentation.planner_first(varying)}


def job_count_metrics(counts: Mapping[str, int]) -> dict[str, int]:
    """`jobs_<status>` for every RunStatus, 0 when no job ended so."""
    return {f"jobs_{status}": counts.get(status, 0) for status in RunStatus}


def place_params(client, parent_run_id: str, sweep_dir: Path, records: Sequence[RunRecord]) -> dict[str, str]:
    """Log the params constant over the sweep once, on the parent, and on each child the keys that
    vary that it does not carry yet (a child logs only filter keys and swept leaves while it runs).
    Returns {varying key: its values} for the description."""
    per_job: list[dict[str, str]] = []
    run_ids: list[str | None] = []
    for record in records:
        path = sweep_dir / record.job / RESOLVED_CONFIG_FILE
        if not path.is_file():
            continue
        # A plain YAML load of what the job wrote (OmegaConf.load + to_container give the same dict, at
        # four times the cost, for every job of the sweep).
        resolved = load_config(path.read_text())
        per_job.append(presentation.config_params(tracking.flatten_params(resolved)))
        run_ids.append(record.mlflow_run_id)
    constant, varying = presentation.split_params(per_job)
    tracking.log_params(client, parent_run_id, constant)
    logged_by_run = tracking.child_params(client, parent_run_id)
    for run_id, params in zip(run_ids, per_job, strict=True):
        if not run_id:
            continue
        logged = logged_by_run[run_id] if run_id in logged_by_run else client.get_run(run_id).data.params
        missing = {k: v for k, v in params.items() if k in varying and k not in logged}
        if missing:
            tracking.log_params(client, run_id, missing)
    values: dict[str, str] = {}
    for key in presentation.planner_first(sorted(varying)):
        seen = list(dict.fromkeys(job[key] for job in per_job if key in job))
        if key.endswith(".source") or len(seen) > 12:
            continue
        values[key] = ", ".join(seen)
    return values


def ui_hint(parent: Mapping[str, Any]) -> str:
    """The command that serves this store and the URL of the runs view (not the GenAI start page)."""
    uri = parent["tracking_uri"]
    url = f"#/experiments/{parent['experiment_id']}/runs?workflowType=machine_learning"
    if uri.startswith("http"):
        return f"MLflow UI: {uri.rstrip('/')}/{url}"
    destination = f" --artifacts-destination {parent['artifact_root']}" if parent.get("artifact_root") else ""
    return f"MLflow UI: mlflow ui --workers 1 --backend-store-uri {uri}{destination}\n  then open http://127.0.0.1:5000/{url}"


def _reopen_parent(client, track: Mapping[str, Any], sweep_dir: Path) -> dict[str, Any] | None:
    """When this sweep folder already has a parent run on the same store (a sweep re-run into its own
    folder to finish it), that run again, so its earlier children stay under it and nothing is
    duplicated; else None (a new parent is created)."""
    path = sweep_dir / PARENT_FILE
    earlier = json.loads(path.read_text()) if path.is_file() else None
    if earlier is None or earlier.get("tracking_uri") != track["uri"]:
        return None
    try:
        client.update_run(earlier["run_id"], status="RUNNING")
        client.set_tag(earlier["run_id"], "status", "running")
    except Exception as exc:  # deleted, or another store: start afresh, say so
        log.warning(
            "parent run %s of %s cannot be reopened (%s); starting a new one", earlier["run_id"], sweep_dir, exc
        )
        return None
    faults.track_in_flight(client, earlier["run_id"])
    return earlier


def sweep_exit_code() -> int:
    """1 when a finished sweep had failed, killed or missing jobs, or its summary could not be written
    (infeasible is a result, not a failure), else 0."""
    state = ACTIVE_SWEEP
    if state is None or not state.finished:
        return 0
    failed = state.status_counts.get(RunStatus.FAILED, 0) + state.status_counts.get(RunStatus.KILLED, 0)
    if failed or state.missing:
        total = sum(state.status_counts.values()) + state.missing
        missing = f", {state.missing} missing" if state.missing else ""
        written = not any(p.startswith("summary.md not written") for p in state.problems)
        where = f"see summary.md in {state.sweep_dir}" if written else "summary printed above"
        print(f"{failed} of {total} jobs failed{missing} ({where})", file=sys.stderr)
    return 1 if failed or state.missing or state.problems else 0


def _killed_in_flight(sweep_dir: Path, signame: str) -> int:
    """Records still saying "running" (status null) belong to jobs cut off before they could write
    again (a launcher's worker killed with the sweep): they say `killed` from now on."""
    from dataclasses import replace

    from pipelines import aggregate

    marked = 0
    for record in aggregate.read_records(sweep_dir).records:
        if record.status is None:
            killed = replace(
                record, status=RunStatus.KILLED, failure_reason=f"interrupted by {signame} while it ran"
            )
            with contextlib.suppress(OSError):
                killed.write(sweep_dir / record.job)
                marked += 1
    return marked


def close_interrupted(exc: faults.Interrupted) -> str:
    """After SIGINT/SIGTERM: in-flight runs and the parent KILLED, the partial summary written.
    Returns the one line to print."""

    signame = signal.Signals(exc.signum).name
    state = ACTIVE_SWEEP
    parent = state.parent if state is not None else None
    faults.kill_in_flight_except(parent["run_id"] if parent else None)
    if state is None or state.finished:
        return f"interrupted by {signame}{faults.interrupted_tail()}"
    parts = [f"interrupted by {signame}"]
    _killed_in_flight(state.sweep_dir, signame)
    result, summary = _partial_summary(state, parts)
    if parent is not None:
        try:
            client = tracking.open_client(parent["tracking_uri"])
            _kill_running_children(client, parent)
            _close_parent(client, parent, result)
            faults.kill_run(client, parent["run_id"])
            killed = client.search_runs(
                [parent["experiment_id"]],
                f"tags.`mlflow.parentRunId` = '{parent['run_id']}' and attributes.status = 'KILLED'",
            )
            parts.append(f"MLflow parent run {parent['run_id']} and {len(killed)} job run(s) marked KILLED")
        except Exception as exc2:
            parts.append(f"MLflow not updated: {type(exc2).__name__}: {exc2}")
    return "; ".join(parts)


def close_failed(exc: faults.Abort) -> str:
    """After a fatal error (an `Abort`: a config mistake before any job, a folder Hydra cannot write,
    an unusable store): runs still open end FAILED, a started sweep gets its partial summary. Returns
    what to add to the error's line."""
    reason = exc.message.removeprefix("error: ")
    state = ACTIVE_SWEEP
    parent = state.parent if state is not None else None
    marked = faults.kill_in_flight_except(parent["run_id"] if parent else None, RunStatus.FAILED, reason)
    if state is None or state.finished:
        return f"; {marked} MLflow run(s) marked FAILED" if marked else ""
    if parent is None and state.sweep_dir.is_dir() and not any(state.sweep_dir.iterdir()):
        state.sweep_dir.rmdir()  # a config mistake before any job: nothing recorded, no folder left
        return ""
    parts: list[str] = []
    result, _ = _partial_summary(state, parts)
    if parent is not None:
        try:
            client = tracking.open_client(parent["tracking_uri"])
            running = _kill_running_children(client, parent, RunStatus.FAILED, reason)
            _close_parent(client, parent, result)
            faults.kill_run(client, parent["run_id"], RunStatus.FAILED, reason)
            parts.append(f"MLflow parent run {parent['run_id']} and {marked + running} job run(s) marked FAILED")
        except Exception as exc2:
            parts.append(f"MLflow not updated: {type(exc2).__name__}: {exc2}")
    return "".join(f"; {part}" for part in parts)


def _partial_summary(state: SweepState, parts: list[str]):
    """Write what the sweep has (to the folder when it can, to stdout in any case); adds to `parts`
    how many jobs have a record and where the summary is. Returns (result or None, summary text)."""
    from pipelines import aggregate

    progress_info = read_progress_quietly(state.sweep_dir)
    total = progress_info["total"] if progress_info else "?"
    try:
        result = aggregate.aggregate_sweep(state.sweep_dir, state.experiment, plots=False, known=state.records)
    except Exception as exc2:
        parts.append(f"0/{total} jobs recorded, no summary ({state.sweep_dir}: {str(exc2).splitlines()[0]})")
        return None, ""
    parts.append(f"{len(result.records)}/{total} jobs recorded")
    if any(path.name == "summary.md" for path in result.files):
        parts.append(f"partial summary {state.sweep_dir / 'summary.md'}")
    else:
        print(result.summary_md)
        parts.append("partial summary printed above (" + "; ".join(result.problems) + ")")
    return result, result.summary_md


def _close_parent(client, parent: Mapping[str, Any], result) -> None:
    counts = dict(result.status_counts) if result is not None else {}
    metrics = job_count_metrics(counts)
    metrics["jobs_total"] = sum(counts.values())
    metrics["jobs_missing"] = result.missing if result is not None else 0
    tracking.log_metrics(client, parent["run_id"], metrics)
    if result is not None and result.files:
        tracking.store_artifacts(client, parent["run_id"], list(result.files), parent.get("artifact_root"))


def _kill_running_children(
    client, parent: Mapping[str, Any], status: RunStatus = RunStatus.KILLED, reason: str = ""
) -> int:
    """Children still RUNNING belong to jobs that were cut off in worker processes (joblib, submitit)."""
    running = client.search_runs(
        [parent["experiment_id"]],
        f"tags.`mlflow.parentRunId` = '{parent['run_id']}' and attributes.status = 'RUNNING'",
    )
    for run in running:
        faults.kill_run(client, run.info.run_id, status, reason)
    return len(running)
