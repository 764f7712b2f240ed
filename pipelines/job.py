"""One Hydra job: resolve and validate the config, run the stages, record the outcome everywhere.

Outcomes, and where each is recorded (run_record.json in the run dir, MLflow run, stdout):
- `ok`: the plan fits the budget. Whether the step also fits the device is a separate verdict
  (`fits_device`), shown beside the status whenever it is false (docs/pipeline.md, "Device fit").
- `infeasible`: the planner raised `InfeasibleBudgetError` or the simulator found the plan does not
  fit; the reason names tensor/op/bytes. The job returns normally: an infeasible budget is a result.
- `failed`: any other exception. In a multirun it is recorded and the job returns, so the rest of the
  sweep still runs and is aggregated; a single run re-raises after recording, so the exit code is 1.

Bad config values raise `ConfigError` before the MLflow run starts (single run); in a multirun they
are recorded as `failed` without doing any work.
"""

from __future__ import annotations

import contextlib
import errno
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

from pipelines import faults, overrides, plots, presentation, progress, provenance, superseded, tracking
from pipelines.config_yaml import dump_config
from pipelines.console import format_summary
from pipelines.records import FINISHED_STATUSES, RECORD_FILE, RunRecord, RunStatus
from slackswap.errors import ConfigError
from slackswap.experiment import RunSpec, run_one, write_run_files

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


def resolve_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config; a missing mandatory value or a broken interpolation (a preset without
    `hidden_size`, say) becomes a `ConfigError` naming the key, like every other bad value."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(key, "???", f"{type(exc).__name__}: {why}") from None


def resolved_yaml(resolved: Mapping[str, Any]) -> str:
    """`OmegaConf.to_yaml(resolved)`, the same text, without first turning the plain dict back into a
    DictConfig (two thirds of that call's cost, paid by every job; `pipelines.config_yaml`)."""
    return dump_config(resolved)


def _unresolved(cfg: DictConfig) -> dict[str, Any]:
    """Best effort view of a config that does not resolve: enough for names, params and the record."""
    data = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    for group in ("model", "hardware", "planner", "budget", "tracking"):
        data.setdefault(group, {})
    data["planner"].setdefault("name", "?")
    data["budget"].setdefault("fraction", None)
    data["budget"].setdefault("bytes", None)
    return data


def run_job(cfg: DictConfig) -> RunRecord:
    t_start = time.perf_counter()
    ctx = JobContext.from_hydra()
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    if not ctx.multirun:
        faults.note_output_dir(ctx.run_dir)
    config_error: ConfigError | None = None
    #: A file of this job that could not be written (a full disk, a read-only folder): one line.
    write_problem: str | None = None
    resolved: dict[str, Any] | None = None
    try:
        resolved = resolve_config(cfg)
        resolved_text = resolved_yaml(resolved)
        overrides.check_traced_attention(resolved, _task_overrides())
        overrides.check_hook(resolved)
        if ctx.multirun:
            earlier = _keep_or_set_aside_earlier(ctx, resolved_text)
            if earlier is not None:
                print(progress.job_line(ctx, earlier, reused=True))
                return earlier
        write_problem = _safe_write(ctx.run_dir / RESOLVED_CONFIG_FILE, resolved_text)
        draw_timeline = plots.plot_level(resolved, ctx.multirun) == "all"
        spec = RunSpec.from_dict(resolved)
    except ConfigError as exc:
        config_error = exc
        resolved = resolved or _unresolved(cfg)
    track = resolved["tracking"]
    parent = read_parent(ctx.sweep_dir) if ctx.multirun and track.get("enabled") else None
    # The model is named after the preset chosen, or after `model.name` when the command line sets it
    # (a user's hook model on a base preset: `model=tiny_torch model.name=my_mlp`).
    labels = dict(ctx.choices)
    named = overrides.override_values(_task_overrides()).get("model.name")
    if named:
        labels["model"] = named
    # Planner first, then only what varies in the sweep (all four parts for a single run).
    name = presentation.run_name(parent.get("varying") if parent else None, labels, resolved)
    record = RunRecord(
        run_name=name,
        choices=dict(ctx.choices),
        model=labels.get("model"),
        hardware=ctx.choices.get("hardware"),
        planner=_planner_label(ctx.choices.get("planner"), resolved["planner"]["name"]),
        planner_name=resolved["planner"]["name"],
        budget_fraction=resolved["budget"]["fraction"],
        budget_bytes_requested=resolved["budget"]["bytes"],
        run_dir=str(ctx.run_dir),
        versions=provenance.versions(),
    )
    # Filled in place as the job goes; every replace() below keeps this same dict.
    timings = record.timings_s
    if config_error is not None:
        record = replace(record, status=RunStatus.FAILED, failure_reason=f"ConfigError: {config_error}")
        if not ctx.multirun:
            # No MLflow run and no stage: the folder keeps only the record, which says why it exists.
            _write_record(record, ctx.run_dir)
            raise config_error
    elif write_problem is not None:
        record = replace(record, status=RunStatus.FAILED, failure_reason=write_problem)
        if not ctx.multirun:  # nothing was recorded anywhere yet: one line, exit 1
            raise faults.Abort(f"error: {write_problem} (run dir {ctx.run_dir})")
    elif ctx.multirun:
        # Status null: "running". A job cut off where it cannot write again (a worker killed by its
        # launcher) still leaves a record, which the launching process turns into `killed`.
        _write_record(record, ctx.run_dir)

    client = None
    artifact_root = track.get("artifact_location")
    artifact_uri = None
    error: BaseException | None = None
    try:
        t0 = time.perf_counter()
        try:
            if track.get("enabled"):
                client, run_info, artifact_root = _start_run(ctx, record, track, parent, artifact_root)
                run_id, artifact_uri = run_info.run_id, run_info.artifact_uri
                record = replace(record, mlflow_run_id=run_id)
                _log_params(client, ctx, record, resolved, parent)
                timings["mlflow_start_s"] = time.perf_counter() - t0
        except Exception as exc:
            if not ctx.multirun:
                raise
            client = None  # a job of a sweep records its failure; the sweep goes on
            if record.status is None:
                record = replace(record, status=RunStatus.FAILED, failure_reason=f"MLflow: {type(exc).__name__}: {exc}")
        if record.status is None:  # no config error, no tracking error: run the stages
            try:
                record = replace(record, **run_stages(spec, ctx.run_dir, draw_timeline, timings))
            except Exception as exc:  # recorded below; a single run exits 1 with one line
                error = exc
                record = replace(record, status=RunStatus.FAILED, failure_reason=failure_reason(exc))
                _remove_partial_file(exc, ctx.run_dir)
                _safe_write(ctx.run_dir / TRACEBACK_FILE, traceback.format_exc())
        problem = _write_record(record, ctx.run_dir)
        if problem is not None and record.status != RunStatus.FAILED:
            # Results that did not reach the disk are not results.
            record = replace(record, status=RunStatus.FAILED, failure_reason=problem)
            error = error or OSError(problem)
        if client is not None:
            t0 = time.perf_counter()
            record, logging_error = _log_outcome(client, record, resolved, ctx.run_dir, artifact_root, artifact_uri)
            if logging_error is not None and error is None:
                error = logging_error
            timings["mlflow_log_s"] = time.perf_counter() - t0
    except KeyboardInterrupt as exc:
        # Wherever it landed (MLflow calls included): the record and the run say killed.
        record = replace(record, status=RunStatus.KILLED, failure_reason="interrupted (SIGINT or SIGTERM)")
        _write_record(record, ctx.run_dir)
        if record.mlflow_run_id:
            faults.release_interrupted_frames(exc)  # they may hold the store's write lock
            faults.kill_in_flight_run(record.mlflow_run_id)
        raise
    timings["job_total_s"] = time.perf_counter() - t_start
    # Rewrite with the final timings (the copy logged to MLflow lacks only the logging time itself).
    _write_record(record, ctx.run_dir)

    print(format_summary(record, resolved) if not ctx.multirun else progress.job_line(ctx, record))
    if error is not None and not ctx.multirun:
        if faults.full_error():
            raise error
        # A bad input found while running (a model the tracer cannot follow: a ConfigError naming the
        # op and the module) exits as every bad config value does, with 2; anything else with 1.
        code = faults.EXIT_CONFIG_ERROR if isinstance(error, ConfigError) else 1
        raise faults.Abort(failed_run_line(record, ctx.run_dir), code=code)
    return record


def failure_reason(exc: BaseException) -> str:
    """`Type: message`; for a file that could not be written, the cause and the path."""
    os_line = faults.describe_os_error(exc)
    return f"{type(exc).__name__}: {os_line}" if os_line else f"{type(exc).__name__}: {exc}"


def failed_run_line(record: RunRecord, run_dir: Path) -> str:
    """The one line a failed single run ends with: the cause, where the details are, the MLflow run."""
    line = f"error: run failed: {record.failure_reason.splitlines()[0] if record.failure_reason else '?'}"
    tb = run_dir / TRACEBACK_FILE
    line += f"; traceback in {tb}" if tb.is_file() and tb.stat().st_size else f"; run dir {run_dir}"
    if record.mlflow_run_id:
        line += f"; MLflow run {record.mlflow_run_id} FAILED"
    return line


def _remove_partial_file(exc: BaseException, run_dir: Path) -> None:
    """A stage file cut short by a full disk is removed: a truncated graph.json reads as a broken
    product, an absent one as what it is (the reason names it)."""
    if not isinstance(exc, OSError) or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return
    path = faults.os_error_path(exc)
    if path and Path(path).resolve().is_relative_to(run_dir.resolve()):
        with contextlib.suppress(OSError):
            Path(path).unlink(missing_ok=True)


def _safe_write(path: Path, text: str) -> str | None:
    """Write `path`; on an OSError (full disk, read-only folder) remove what was left half-written and
    return one line naming the cause and the path, instead of raising inside an error handler."""
    try:
        path.write_text(text)
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return f"{path.name} not written: {faults.os_error_line(exc)}"
    return None


def _write_record(record: RunRecord, run_dir: Path) -> str | None:
    """`record.write`, returning the problem instead of raising (see `_safe_write`)."""
    return _safe_write(Path(run_dir) / RECORD_FILE, record.to_json())


def _task_overrides() -> list[str]:
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # no Hydra context (a test calling run_job directly)
        return []


def run_stages(spec: RunSpec, run_dir: Path, draw_timeline: bool, timings: dict[str, float]) -> dict[str, Any]:
    """Run the spec (`slackswap.experiment.run_one`), write its run directory (docs/contract.md) and
    its timeline; the record fields of the outcome."""
    outcome = run_one(spec, timings)
    write_run_files(spec, outcome, run_dir, timings)
    if draw_timeline:
        plots.draw_timeline(spec, outcome, run_dir, timings)
    facts = {"swapped": list(outcome.swapped), "recomputed": list(outcome.recomputed)} if outcome.plan else {}
    return {
        "status": RunStatus(outcome.verdict),
        "failure_reason": outcome.reason,
        "metrics": dict(outcome.metrics),
        "facts": facts,
    }


def _start_run(ctx: JobContext, record: RunRecord, track: Mapping[str, Any], parent, artifact_root):
    """Create this job's MLflow run (a child of the sweep's parent in a multirun), tracked in flight
    so an interrupt marks it KILLED. Returns (client, the run's RunInfo, artifact_root)."""
    if parent is not None:
        client = tracking.open_client(parent["tracking_uri"])
        experiment_id, parent_run_id = parent["experiment_id"], parent["run_id"]
        artifact_root = parent.get("artifact_root", artifact_root)
    else:
        client = tracking.open_client(track["uri"])
        experiment_id = tracking.ensure_experiment(client, track["experiment"], track["artifact_location"])
        parent_run_id = None
    run_info = tracking.create_run(client, experiment_id, record.run_name, _choice_tags(ctx.choices), parent_run_id)
    faults.track_in_flight(client, run_info.run_id)
    return client, run_info, artifact_root


def _log_params(client, ctx: JobContext, record: RunRecord, resolved: Mapping[str, Any], parent) -> None:
    """The run's params and presets; a failure here ends the run FAILED before it is re-raised."""
    flat = presentation.config_params(tracking.flatten_params(resolved))
    params = presentation.filter_params(ctx.choices, record.planner, resolved)
    if parent is not None:
        # Constants go to the parent at the end of the sweep (callbacks.SweepCallback): a child
        # carries the filter keys and what its sweep varies.
        params |= presentation.swept_value_params(parent.get("varying", ()), flat)
    else:
        params |= flat
    try:
        tracking.log_params(client, record.mlflow_run_id, params)
        tracking.log_presets(
            client,
            record.mlflow_run_id,
            {g: (ctx.choices.get(g, resolved[g]["name"]), resolved[g]) for g in ("model", "hardware")},
        )
    except Exception:
        with contextlib.suppress(Exception):
            tracking.end_run(client, record.mlflow_run_id, RunStatus.FAILED)
        faults.done_in_flight(record.mlflow_run_id)
        raise


def _log_outcome(
    client, record: RunRecord, resolved: Mapping[str, Any], run_dir: Path, artifact_root, artifact_uri=None
) -> tuple[RunRecord, Exception | None]:
    """Metrics, tags and artifacts, then end the run. A run whose results did not reach the store is
    `failed` (never FINISHED with status ok): the record and the run's tags say what failed. Returns
    the record as it ended and that logging error, if any."""
    run_id = record.mlflow_run_id
    logging_error: Exception | None = None
    try:
        tracking.log_results(client, run_id, presentation.with_units(record.metrics), _outcome_tags(record, resolved))
        tracking.store_artifacts(client, run_id, run_dir, artifact_root, artifact_uri)
    except Exception as exc:
        logging_error = exc
        reason = f"MLflow logging failed: {type(exc).__name__}: {exc}"
        record = replace(record, status=RunStatus.FAILED, failure_reason=reason)
        _write_record(record, run_dir)
        with contextlib.suppress(Exception):  # best effort: the store may be what failed
            tracking.log_tags(client, run_id, _outcome_tags(record, resolved))
    finally:
        tracking.end_run(client, run_id, record.status)
        faults.done_in_flight(run_id)
    return record, logging_error


def _outcome_tags(record: RunRecord, resolved: Mapping[str, Any]) -> dict[str, str]:
    tags = {"status": str(record.status), tracking.NOTE_TAG: presentation.child_description(record, resolved)}
    fits = (record.metrics or {}).get("fits_device")
    if fits is not None:  # searchable in the run list: tags.fits_device = 'false'
        tags["fits_device"] = str(bool(fits)).lower()
    if record.failure_reason:
        tags["reason"] = _clip(record.failure_reason)
    return tags


#: Outcomes a re-run of the same sweep into the same folder keeps instead of running the job again.
REUSABLE_STATUSES = FINISHED_STATUSES
SUPERSEDED_DIR = superseded.SUPERSEDED_DIR


def _keep_or_set_aside_earlier(ctx: JobContext, resolved_yaml: str) -> RunRecord | None:
    """A sweep re-run into its own folder neither duplicates nor loses results.

    The job's folder already holds a finished result (ok or infeasible) of the same resolved config:
    return that record, and the job is not run again (no second MLflow run). Anything else already there
    (a failed or killed attempt, another config under the same job number, or a record this version
    cannot read) is moved to `<sweep dir>/superseded/<job>-<n>/` before the job runs, so it is kept but
    not aggregated.
    """
    record_path = ctx.run_dir / RECORD_FILE
    if not record_path.is_file():
        return None
    try:
        earlier = RunRecord.read(record_path)
    except ValueError:  # not JSON, or not a RunRecord (ConfigError): kept aside, never reused
        earlier = None
    config_path = ctx.run_dir / RESOLVED_CONFIG_FILE
    same_config = config_path.is_file() and config_path.read_text() == resolved_yaml
    if same_config and earlier is not None and earlier.status in REUSABLE_STATUSES:
        return earlier
    aside_root = ctx.sweep_dir / SUPERSEDED_DIR
    aside_root.mkdir(exist_ok=True)
    attempt = 1 + sum(1 for _ in aside_root.glob(f"{ctx.run_dir.name}-*"))
    aside = aside_root / f"{ctx.run_dir.name}-{attempt}"
    aside.mkdir()
    for path in ctx.run_dir.iterdir():
        if path.name != ".hydra" and path.suffix != ".log":
            path.rename(aside / path.name)
    return None


def _planner_label(choice: str | None, name: str) -> str:
    return name if choice in (None, name) else f"{choice}[{name}]"


def _choice_tags(choices: Mapping[str, str]) -> dict[str, str]:
    return {f"choice.{group}": value for group, value in choices.items()} | {"status": "running"}


def _clip(text: str) -> str:
    if len(text) <= MAX_TAG_CHARS:
        return text
    return text[:MAX_TAG_CHARS] + f" ... [truncated; full text in {RECORD_FILE}]"
