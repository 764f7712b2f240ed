"""MLflow logging for one job or one sweep, through `MlflowClient` only.

Why the client and not the fluent `mlflow.start_run()`: the fluent API keeps a per-process stack of
active runs. With Hydra's basic launcher every job of a sweep shares one process, and a run left on
that stack breaks the next job ("Run ... is already active"). The client API is stateless: a run is an
id, and it is ended explicitly in the caller's `finally`.

`mlflow` is imported lazily (about 2 s on 2 cores): the library never imports it, and `tracking=off`
runs never pay for it.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import slackswap
from pipelines.records import RunStatus
from pipelines.schemas import REPO_ROOT

#: Tag keys MLflow's UI understands.
PARENT_RUN_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"


def flatten_params(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"model.num_layers": "24", ...}. None becomes "null", lists become JSON."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{name}."))
        elif value is None:
            flat[name] = "null"
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(list(value))
        else:
            flat[name] = str(value)
    return flat


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics MLflow can store: numbers and booleans (as 0/1). None (not defined for this run,
    e.g. the step time of an infeasible plan) and text (`infeasible_reason`, logged as the
    `failure_reason` tag) are left out; anything else is a bug in the producer and raises."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if value is None or isinstance(value, str):
            continue
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            if not math.isfinite(value):
                raise ValueError(f"metric {key}={value!r} is not finite")
            out[key] = float(value)
        else:
            raise TypeError(f"metric {key}={value!r} is not a number or a boolean")
    return out


@cache
def git_commit() -> str:
    """HEAD of the repository the code runs from, with `-dirty` when tracked files are modified."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"
    return f"{sha}-dirty" if dirty else sha


def provenance_tags() -> dict[str, str]:
    return {"git_commit": git_commit(), "slackswap_version": slackswap.__version__}


def open_client(uri: str):
    """An `MlflowClient` on `uri`; a sqlite URI gets its parent folder created first."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def ensure_experiment(client, name: str, artifact_root: str | None) -> str:
    """Experiment id for `name`, created (with artifacts under `artifact_root/name`) if missing.

    Without an explicit location MLflow puts artifacts under `./mlruns` of whatever the working
    directory happens to be, so a local store always passes one.
    """
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage != "active":
            raise RuntimeError(
                f"tracking.experiment={name!r} is deleted in this store; restore it or choose another name"
            )
        return experiment.experiment_id
    location = None if artifact_root is None else Path(artifact_root, name).resolve().as_uri()
    return client.create_experiment(name, artifact_location=location)


def start_run(client, experiment_id: str, run_name: str, tags: Mapping[str, str], parent_run_id: str | None) -> str:
    all_tags = {RUN_NAME_TAG: run_name, **provenance_tags(), **tags}
    if parent_run_id is not None:
        all_tags[PARENT_RUN_TAG] = parent_run_id
    run = client.create_run(experiment_id, tags=all_tags, run_name=run_name)
    return run.info.run_id


def log_params(client, run_id: str, params: Mapping[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), 100):  # the store accepts at most 100 params per batch
        client.log_batch(run_id, params=items[start : start + 100])


def log_tags(client, run_id: str, tags: Mapping[str, str]) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_metrics(client, run_id: str, metrics: Mapping[str, Any]) -> None:
    import time

    from mlflow.entities import Metric

    now_ms = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now_ms, 0) for k, v in numeric_metrics(metrics).items()])


def log_artifacts(client, run_id: str, folder: Path) -> None:
    client.log_artifacts(run_id, str(folder))


def backfill_bound_gaps(client, frame) -> int:
    """Log `best_bound_s` and `gap_to_bound` onto each finished child run the aggregate could price.

    A job cannot know the bound while it runs: the milp job of the same problem may finish later. The
    aggregate joins them, and this writes the result back so every run in the MLflow UI carries its
    certified distance to the optimum. Returns the number of runs updated.
    """
    updated = 0
    for row in frame.itertuples():
        run_id = row.mlflow_run_id
        if not isinstance(run_id, str) or not run_id or row.gap_to_bound != row.gap_to_bound:  # NaN: no bound
            continue
        log_metrics(client, run_id, {"best_bound_s": row.best_bound_s, "gap_to_bound": row.gap_to_bound})
        updated += 1
    return updated


#: MLflow run status per outcome. Only `ok` finishes; the outcome itself is the `status` tag.
_MLFLOW_STATUS = {
    RunStatus.OK: "FINISHED",
    RunStatus.INFEASIBLE: "FAILED",
    RunStatus.FAILED: "FAILED",
    RunStatus.KILLED: "KILLED",
}


def end_run(client, run_id: str, status: RunStatus) -> None:
    client.set_terminated(run_id, status=_MLFLOW_STATUS[RunStatus(status)])
