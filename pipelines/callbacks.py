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

import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipelines import aggregate, faults, tracking
from pipelines.job import PARENT_FILE
from pipelines.progress import read_progress

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


#: Set by on_multirun_start in the launching process; read by `pipelines.run` for the exit code and
#: by the interrupt handler.
ACTIVE_SWEEP: SweepState | None = None


class SweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global ACTIVE_SWEEP
        try:
            HydraConfig.instance().set_config(config)  # ${hydra:...} is not set yet on hydra 1.3.8
            sweep_dir = Path(config.hydra.sweep.dir)
            sweep_dir.mkdir(parents=True, exist_ok=True)
            experiment = OmegaConf.to_container(config.experiment, resolve=True)
            ACTIVE_SWEEP = SweepState(sweep_dir, experiment, time.perf_counter())
            track = OmegaConf.to_container(config.tracking, resolve=True)
            if not track["enabled"]:
                return
            client = tracking.open_client(track["uri"])
            ACTIVE_SWEEP.parent = _open_parent(client, config, track, sweep_dir)
            log.info(
                "MLflow parent run %s in experiment %r (%s)",
                ACTIVE_SWEEP.parent["run_id"],
                track["experiment"],
                track["uri"],
            )
        except tracking.TrackingUnavailable as exc:
            # Before any job launches, once: every job would fail the same way.
            raise faults.Abort(f"error: {exc}") from None
        except Exception:
            log.exception("SweepCallback.on_multirun_start failed: jobs cannot be tracked")
            raise

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            HydraConfig.instance().set_config(config)
            state = ACTIVE_SWEEP or SweepState(
                Path(config.hydra.sweep.dir),
                OmegaConf.to_container(config.experiment, resolve=True),
                time.perf_counter(),
            )
            result = aggregate.aggregate_sweep(state.sweep_dir, state.experiment)
            state.status_counts = dict(result.status_counts)
            state.finished = True
            print(result.summary_md)
            if result.paper_table_md:
                print(result.paper_table_md)
            parent = read_parent_if_any(state.sweep_dir)
            if parent is None:
                return
            client = tracking.open_client(parent["tracking_uri"])
            _close_parent(client, parent, result, state, status="FINISHED")
            print(f"aggregate: {state.sweep_dir} (MLflow parent run {parent['run_id']})")
        except Exception:
            log.exception("SweepCallback.on_multirun_end failed: the sweep was not aggregated")
            raise


def read_parent_if_any(sweep_dir: Path) -> dict[str, str] | None:
    path = sweep_dir / PARENT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _open_parent(client, config: DictConfig, track: dict[str, Any], sweep_dir: Path) -> dict[str, str]:
    """The sweep's parent run: a new one, or, when this sweep directory already has one on the same
    store (a sweep re-run into its own folder to finish it), that one again, so its earlier children
    stay under it and nothing is duplicated."""
    earlier = read_parent_if_any(sweep_dir)
    if earlier is not None and earlier.get("tracking_uri") == track["uri"]:
        try:
            client.update_run(earlier["run_id"], status="RUNNING")
            faults.track_in_flight(client, earlier["run_id"])
            return earlier
        except Exception as exc:  # deleted or from another store: start afresh, say so
            log.warning(
                "parent run %s of %s cannot be reopened (%s); starting a new one", earlier["run_id"], sweep_dir, exc
            )
    experiment_id = tracking.ensure_experiment(client, track["experiment"], track["artifact_location"])
    experiment_name = OmegaConf.select(config, "experiment.name")
    run_id = tracking.start_run(
        client,
        experiment_id,
        run_name=f"sweep:{experiment_name}:{sweep_dir.name}",
        tags={"sweep_dir": str(sweep_dir.resolve()), "experiment_preset": str(experiment_name)},
        parent_run_id=None,
    )
    faults.track_in_flight(client, run_id)
    tracking.log_params(client, run_id, {"sweep.overrides": " ".join(config.hydra.overrides.task)})
    parent = {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": track["uri"]}
    (sweep_dir / PARENT_FILE).write_text(json.dumps(parent, indent=2))
    return parent


def _close_parent(client, parent: dict[str, str], result, state: SweepState, status: str) -> None:
    counts = result.status_counts if result is not None else {}
    tracking.log_metrics(
        client,
        parent["run_id"],
        {
            "jobs_total": sum(counts.values()),
            "jobs_ok": counts.get("ok", 0),
            "jobs_infeasible": counts.get("infeasible", 0),
            "jobs_failed": counts.get("failed", 0),
            "jobs_killed": counts.get("killed", 0),
            "sweep_wall_s": time.perf_counter() - state.t_start,
        },
    )
    if result is not None:
        tracking.backfill_bound_gaps(client, result.table)
        for path in result.files:
            client.log_artifact(parent["run_id"], str(path))
    client.set_terminated(parent["run_id"], status=status)
    faults.done_in_flight(parent["run_id"])


def sweep_exit_code() -> int:
    """1 when a finished sweep had failed jobs (infeasible is a result, not a failure), else 0."""
    state = ACTIVE_SWEEP
    if state is None or not state.finished:
        return 0
    failed = state.status_counts.get("failed", 0) + state.status_counts.get("killed", 0)
    if failed:
        print(
            f"{failed} of {sum(state.status_counts.values())} jobs failed (see summary.md in {state.sweep_dir})",
            file=sys.stderr,
        )
    return 1 if failed else 0


def close_interrupted(exc: faults.Interrupted) -> str:
    """After SIGINT/SIGTERM: in-flight runs and the parent KILLED, the partial summary written.
    Returns the one line to print."""
    signame = signal.Signals(exc.signum).name
    killed_here = faults.kill_in_flight_except(
        ACTIVE_SWEEP.parent["run_id"] if ACTIVE_SWEEP and ACTIVE_SWEEP.parent else None
    )
    state = ACTIVE_SWEEP
    if state is None or state.finished:
        return f"interrupted by {signame}; {killed_here} MLflow run(s) marked KILLED"
    parts = [f"interrupted by {signame}"]
    progress_info = read_progress(state.sweep_dir)
    records = len(aggregate.load_records(state.sweep_dir))
    total = progress_info["total"] if progress_info else "?"
    parts.append(f"{records}/{total} jobs recorded")
    result = None
    if records:
        try:
            result = aggregate.aggregate_sweep(state.sweep_dir, state.experiment)
            parts.append(f"partial summary {state.sweep_dir / 'summary.md'}")
        except Exception as exc2:
            parts.append(f"partial summary failed: {exc2}")
    else:
        parts.append(f"no job finished, no summary ({state.sweep_dir})")
    parent = state.parent
    if parent is not None:
        try:
            client = tracking.open_client(parent["tracking_uri"])
            _kill_running_children(client, parent)
            _close_parent(client, parent, result, state, status="KILLED")
            killed = client.search_runs(
                [parent["experiment_id"]],
                f"tags.`mlflow.parentRunId` = '{parent['run_id']}' and attributes.status = 'KILLED'",
            )
            parts.append(f"MLflow parent run {parent['run_id']} and {len(killed)} job run(s) marked KILLED")
        except Exception as exc2:
            parts.append(f"MLflow not updated: {type(exc2).__name__}: {exc2}")
    return "; ".join(parts)


def _kill_running_children(client, parent: dict[str, str]) -> int:
    """Children still RUNNING belong to jobs that were cut off in worker processes (joblib, submitit)."""
    running = client.search_runs(
        [parent["experiment_id"]],
        f"tags.`mlflow.parentRunId` = '{parent['run_id']}' and attributes.status = 'RUNNING'",
    )
    for run in running:
        faults.kill_run(client, run.info.run_id)
    return len(running)
