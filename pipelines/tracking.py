"""MLflow logging for one job or one sweep, through `MlflowClient` only.

Why the client and not the fluent `mlflow.start_run()`: the fluent API keeps a per-process stack of
active runs. With Hydra's basic launcher every job of a sweep shares one process, and a run left on
that stack breaks the next job ("Run ... is already active"). The client API is stateless: a run is an
id, and it is ended explicitly in the caller's `finally`.

`mlflow` is imported lazily (about 2 s on 2 cores): the library never imports it, and `tracking=off`
runs never pay for it.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import math
import os
import shutil
from collections.abc import Mapping
from contextlib import suppress
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import slackswap
from pipelines.records import RunStatus

#: Tag keys MLflow's UI understands.
PARENT_RUN_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"
NOTE_TAG = "mlflow.note.content"  # the run's (or experiment's) Description in the UI
#: Artifact locations of experiments this code creates in a local store: resolved by the serving
#: `mlflow ui/server --artifacts-destination <store>/mlruns`, so they hold no path of one machine and
#: survive moving or cloning the folder (docs/pipeline.md, "Portable store").
PROXIED_SCHEME = "mlflow-artifacts"

#: Our job outcomes -> MLflow run status. An infeasible budget is a result, so the run FINISHED.
MLFLOW_STATUS = {
    RunStatus.OK: "FINISHED",
    RunStatus.INFEASIBLE: "FINISHED",
    RunStatus.FAILED: "FAILED",
    RunStatus.KILLED: "KILLED",
}


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


def provenance_tags(source_name: str = "pipelines/run.py") -> dict[str, str]:
    """MLflow's standard fields (the UI's Source, User, commit, branch), the dirty flag, the library
    version and the versions of what ran (`pipelines.provenance`).

    The client API, unlike the fluent one, fills none of them: they come from MLflow's own context
    providers (`mlflow.tracking.context.registry.resolve_tags`), with two corrections. The source name
    is the entry point relative to the repository (MLflow's is `sys.argv[0]`, an absolute path of one
    machine, and for `python -m` the same file whatever the entry point), and the commit is the one of
    the repository the code runs from, whose dirty state MLflow's git context does not report:
    `mlflow.source.git.dirty` (MLflow's key) counts untracked presets too.
    """
    return dict(_provenance_tags(source_name))


@cache
def _provenance_tags(source_name: str) -> tuple[tuple[str, str], ...]:
    from mlflow.tracking.context.registry import resolve_tags
    from mlflow.utils.mlflow_tags import (
        MLFLOW_GIT_COMMIT,
        MLFLOW_GIT_DIRTY,
        MLFLOW_GIT_REPO_URL,
        MLFLOW_SOURCE_NAME,
        MLFLOW_USER,
    )

    from pipelines import provenance

    tags = {k: str(v) for k, v in resolve_tags().items() if k.startswith("mlflow.")}
    tags.pop(MLFLOW_GIT_COMMIT, None)
    if not tags.get(MLFLOW_GIT_REPO_URL, "").startswith(("https://", "http://", "git@", "ssh://")):
        tags.pop(MLFLOW_GIT_REPO_URL, None)  # a clone's remote on this machine: a local path
    tags[MLFLOW_SOURCE_NAME] = source_name
    tags.setdefault("mlflow.source.type", "LOCAL")
    tags.setdefault(MLFLOW_USER, _user())
    commit = provenance.git_commit()
    if not commit.startswith("unknown"):
        tags[MLFLOW_GIT_COMMIT] = commit.removesuffix("-dirty")
        tags[MLFLOW_GIT_DIRTY] = str(commit.endswith("-dirty")).lower()
    tags["slackswap_version"] = slackswap.__version__
    tags |= provenance.version_tags()
    return tuple(sorted(tags.items()))


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        return os.environ.get("USER", "unknown")


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be used (unreachable server, corrupt or foreign database). The
    message names the URI or the path, fits on one line, and is printed without a traceback."""


#: How long a process waits for another one that is creating or migrating the same SQLite store.
STORE_LOCK_TIMEOUT_S = 120.0
#: An unreachable server fails within this many seconds, naming the URI (MLflow's own retries with
#: back-off took 248 s). Also the per-request timeout and retry count of MLflow's HTTP client, unless
#: the user set MLFLOW_HTTP_REQUEST_TIMEOUT / MLFLOW_HTTP_REQUEST_MAX_RETRIES.
SERVER_PROBE_TIMEOUT_S = 5.0
SERVER_HTTP_MAX_RETRIES = 2


def sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def check_sqlite_store(path: Path) -> None:
    """Refuse a file that is not an MLflow SQLite store, naming the path, before MLflow touches it.

    A missing or empty file is fine (MLflow creates the schema). A non-SQLite file would otherwise fail
    deep inside SQLAlchemy ("file is not a database", 77 lines, no path), and a SQLite file of another
    program would get MLflow's tables added to it.
    """
    import sqlite3
    from contextlib import closing

    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.OperationalError:
        return  # busy, locked, a hot journal of a writer in progress: a live store, MLflow takes it from here
    except sqlite3.DatabaseError as exc:  # "file is not a database"
        raise TrackingUnavailable(f"tracking store {path} is not an MLflow SQLite database ({exc})") from None
    if tables and not {"experiments", "runs", "alembic_version"} <= tables:
        shown = ", ".join(sorted(tables)[:5])
        raise TrackingUnavailable(f"tracking store {path} is a SQLite database of another program (tables: {shown})")


def check_store_writable(path: Path) -> None:
    """Refuse a read-only store, naming the path, before MLflow touches it.

    MLflow writes on every run (the run row, params, metrics), and SQLite writes a journal next to
    the database: a read-only `mlflow.db` (or its folder) otherwise failed at the first write, inside
    SQLAlchemy's autoflush, with 92 lines and neither the path nor "read-only" in them. `os.access`
    answers for the effective user and, for root too, for a read-only mount (EROFS)."""
    if path.exists() and not os.access(path, os.W_OK):
        raise TrackingUnavailable(
            f"tracking store {path} is read-only: make it writable or choose another tracking.uri (tracking=off "
            "records nothing)"
        )
    if not os.access(path.parent, os.W_OK):
        raise TrackingUnavailable(
            f"tracking store {path} is in a read-only folder ({path.parent}: SQLite writes its journal and "
            "the store's lock there): make it writable or choose another tracking.uri (tracking=off records "
            "nothing)"
        )


def probe_server(uri: str, timeout_s: float = SERVER_PROBE_TIMEOUT_S) -> None:
    """Fail fast, naming the URI, when no MLflow server answers at `uri`."""
    import urllib.error
    import urllib.request

    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (http(s) only)
            response.read(64)
    except urllib.error.HTTPError:
        return  # a server answered (an older one without /health, or behind auth): MLflow takes it from here
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TrackingUnavailable(
            f"tracking.uri={uri}: no MLflow server answers ({reason}); start one (`mlflow server`) or choose "
            "tracking=local / tracking=off"
        ) from None


def open_client(uri: str):
    """An `MlflowClient` on `uri`, with the store checked and, for SQLite, created under a file lock.

    MLflow creates and migrates a fresh SQLite schema in whichever process opens it first, without a
    lock: two processes doing that at once corrupt the database for good ("table _alembic_tmp_... already
    exists", "duplicate column name"). `<db>.lock` next to the database serialises that step across
    processes (and hosts sharing the folder, as far as the filesystem's locks reach); once the schema
    exists, concurrent writers are fine.

    MLflow is imported only once the checks pass: a store refused (no server answers, a read-only or
    foreign database) costs its one line, not MLflow's import (about 1 s of CPU).
    """
    import os

    from pipelines.heavy_imports import import_paused

    db = sqlite_path(uri)
    if db is None:
        if uri.startswith(("http://", "https://")):
            probe_server(uri)
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(SERVER_PROBE_TIMEOUT_S * 2)))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(SERVER_HTTP_MAX_RETRIES))
        return import_paused("mlflow.tracking").MlflowClient(tracking_uri=uri)
    from filelock import FileLock, Timeout

    try:
        db.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrackingUnavailable(f"tracking store {db}: its folder cannot be created ({exc.strerror})") from None
    check_sqlite_store(db)
    check_store_writable(db)
    MlflowClient = import_paused("mlflow.tracking").MlflowClient  # noqa: N806 (a class)
    lock = FileLock(str(db) + ".lock")
    # A warm-up only: the module the client constructs for SQLite, imported here with the collector
    # paused and outside the lock. The client never needs it by this name, so a MLflow that moves it
    # costs this warm-up, not the run (no pin depends on MLflow's store layout).
    with suppress(ImportError):
        import_paused("mlflow.store.tracking.sqlalchemy_store")
    try:
        with lock.acquire(timeout=STORE_LOCK_TIMEOUT_S):
            return _sqlite_client(MlflowClient, uri, db)
    except Timeout:
        raise TrackingUnavailable(
            f"tracking store {db}: another process held {lock.lock_file} for {STORE_LOCK_TIMEOUT_S:.0f} s"
        ) from None


def _sqlite_client(client_class, uri: str, db: Path):
    """Construct the client (MLflow creates or migrates the schema here) and turn store errors into
    one line naming the database."""
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return client_class(tracking_uri=uri)
    except (MlflowException, SQLAlchemyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrackingUnavailable(f"tracking store {db} cannot be opened: {first_line[:300]}") from None


def ensure_experiment(client, name: str, artifact_root: str | None) -> str:
    """Experiment id for `name`, created if missing, its artifacts under `artifact_root/name`.

    Without an explicit location MLflow puts artifacts under `./mlruns` of whatever the working
    directory happens to be, so a local store always passes one. The location is recorded as
    `mlflow-artifacts:/<name>`, not as an absolute `file://` URI: the UI resolves it against its
    `--artifacts-destination`, so the store keeps working after the folder is moved or cloned.
    """
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage != "active":
            raise RuntimeError(
                f"tracking.experiment={name!r} is deleted in this store; restore it or choose another name"
            )
        return experiment.experiment_id
    location = None if artifact_root is None else f"{PROXIED_SCHEME}:/{name}"
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:
        # Another process created it between our lookup and our insert: use theirs.
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


#: MLflow's limit on an experiment tag's value (mlflow.utils.validation.MAX_EXPERIMENT_TAG_VAL_LENGTH).
EXPERIMENT_TAG_MAX_CHARS = 20000


def set_experiment_description(client, experiment_id: str, text: str) -> None:
    """The experiment's description; a long sweep's (hundreds of jobs) is cut at MLflow's limit with a
    pointer to the parent run, whose artifacts hold the whole table."""
    if len(text) > EXPERIMENT_TAG_MAX_CHARS:
        tail = "\n\n... (cut at MLflow's limit; the whole table is in the parent run's artifacts)"
        text = text[: EXPERIMENT_TAG_MAX_CHARS - len(tail)] + tail
    client.set_experiment_tag(experiment_id, NOTE_TAG, text)


def create_run(
    client,
    experiment_id: str,
    run_name: str,
    tags: Mapping[str, str],
    parent_run_id: str | None,
    source_name: str = "pipelines/run.py",
):
    """Start a run with its name, provenance and `tags`; returns its `RunInfo` (id and artifact URI)."""
    all_tags = {RUN_NAME_TAG: run_name, **provenance_tags(source_name), **tags}
    if parent_run_id is not None:
        all_tags[PARENT_RUN_TAG] = parent_run_id
    return client.create_run(experiment_id, tags=all_tags, run_name=run_name).info


def child_params(client, parent_run_id: str) -> dict[str, dict[str, str]]:
    """{run id: params} of the parent's child runs, read in pages of one search each rather than one
    `get_run` per child (a run not found here, e.g. in another experiment, is read by the caller)."""
    parent = client.get_run(parent_run_id)
    found: dict[str, dict[str, str]] = {}
    token = None
    while True:
        page = client.search_runs(
            [parent.info.experiment_id],
            f"tags.`{PARENT_RUN_TAG}` = '{parent_run_id}'",
            max_results=1000,
            page_token=token,
        )
        found |= {run.info.run_id: run.data.params for run in page}
        token = page.token
        if not token:
            return found


def log_presets(client, run_id: str, presets: Mapping[str, tuple[str, Mapping[str, Any]]]) -> None:
    """Log each preset (`{"model": ("gpt2_xl", {...resolved node...})}`) as an MLflow dataset input, so
    the UI's Dataset column says which model and hardware ran. The digest changes with any field
    overridden on the command line, so `gpt2_xl` with a different digest is not the shipped preset."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = []
    for context, (name, node) in presets.items():
        body = json.dumps(node, sort_keys=True, default=str)
        dataset = Dataset(
            name=name,
            digest=hashlib.sha256(body.encode()).hexdigest()[:8],
            source_type="local",
            source=json.dumps({"uri": f"conf/{context}/{name}.yaml"}),
            profile=body,
        )
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)]))
    try:
        client.log_inputs(run_id, datasets=inputs)
    except Exception as exc:
        # MLflow checks whether the dataset exists, then inserts it: two jobs of a parallel sweep
        # logging the same preset at once collide on the datasets table's unique key. The loser's
        # second attempt finds the winner's row and only links it.
        if "UNIQUE constraint" not in str(exc) and "already exists" not in str(exc):
            raise
        client.log_inputs(run_id, datasets=inputs)


def log_params(client, run_id: str, params: Mapping[str, str]) -> None:
    """All params in one `log_batch`: MLflow's client splits it into the store's batch limits."""
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])


def log_tags(client, run_id: str, tags: Mapping[str, str]) -> None:
    log_results(client, run_id, {}, tags)


def log_metrics(client, run_id: str, metrics: Mapping[str, Any]) -> None:
    """Log the numeric metrics (see `numeric_metrics`) in one batch."""
    log_results(client, run_id, metrics, {})


def log_results(client, run_id: str, metrics: Mapping[str, Any], tags: Mapping[str, str]) -> None:
    """Numeric metrics (see `numeric_metrics`) and tags in one `log_batch`: one store transaction for
    a job's outcome (each reads the run back, about 5 ms on a local SQLite store). MLflow's client
    splits a batch over its limits (100 tags, 1000 metrics, 1000 entities) itself."""
    import time

    from mlflow.entities import Metric, RunTag

    now_ms = int(time.time() * 1000)
    metric_items = [Metric(k, v, now_ms, 0) for k, v in numeric_metrics(metrics).items()]
    tag_items = [RunTag(k, str(v)) for k, v in tags.items()]
    client.log_batch(run_id, metrics=metric_items, tags=tag_items)


def local_artifact_dir(artifact_uri: str, artifact_root: str | Path | None) -> Path | None:
    """Where a run's artifacts live on this machine, or None when a server holds them.

    `mlflow-artifacts:/<exp>/<run>/artifacts` is resolved against `artifact_root` (the store's
    `mlruns/`, what `mlflow ui --artifacts-destination` serves); `file://` URIs (experiments created
    by older versions) are their path.
    """
    parsed = urlparse(artifact_uri)
    if parsed.scheme == PROXIED_SCHEME:
        if artifact_root is None:
            return None
        return Path(artifact_root) / unquote(parsed.path).lstrip("/")
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and artifact_uri.startswith("/"):
        return Path(artifact_uri)
    return None


def store_artifacts(
    client, run_id: str, files: list[Path] | Path, artifact_root: str | Path | None, artifact_uri: str | None = None
) -> int:
    """Store the files (or every file under a folder, keeping its layout) as the run's artifacts.

    Stored once: in a local store each artifact is a hard link to the file in the run directory, so
    the bytes exist once on disk however many names they have (a copy only where a hard link cannot
    be made, e.g. another filesystem). A server's store gets them uploaded through the client.
    Returns the bytes added to the disk (0 when every file was linked). `artifact_uri`: the run's, when
    the caller knows it from creating the run (saves reading the run back).
    """
    if isinstance(files, Path):
        base = files
        pairs = [(p, p.relative_to(base)) for p in sorted(base.rglob("*")) if p.is_file()]
    else:
        pairs = [(p, Path(p.name)) for p in files]
    if artifact_uri is None:
        artifact_uri = client.get_run(run_id).info.artifact_uri
    dest_root = local_artifact_dir(artifact_uri, artifact_root)
    if dest_root is None:
        if urlparse(artifact_uri).scheme == PROXIED_SCHEME and not client.tracking_uri.startswith("http"):
            raise RuntimeError(
                f"run {run_id}: artifacts at {artifact_uri} need tracking.artifact_location "
                "(the folder `mlflow ui --artifacts-destination` serves), which is null"
            )
        for src, rel in pairs:
            parent = str(rel.parent) if str(rel.parent) != "." else None
            client.log_artifact(run_id, str(src), artifact_path=parent)
        return sum(src.stat().st_size for src, _ in pairs)
    copied = 0
    for src, rel in pairs:
        dest = dest_root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        try:
            os.link(src, dest)
        except OSError:
            shutil.copyfile(src, dest)
            copied += src.stat().st_size
    return copied


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


def end_run(client, run_id: str, status: RunStatus) -> None:
    """End a run with the MLflow status of our outcome `status`."""
    client.set_terminated(run_id, status=MLFLOW_STATUS[status])
