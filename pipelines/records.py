"""The typed record of one job: what `run_record.json` holds, and the outcome vocabulary.

One `RunRecord` type and one `RunStatus` enum, shared by the job (builds and writes the record),
tracking (tags and ends the MLflow run from its status) and aggregate (reads a sweep's records
back). The JSON keys are the dataclass fields, so a record read back is the record written, and
`RunStatus` is a StrEnum so the strings in JSON files and MLflow tags are the same as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from slackswap.errors import ConfigError, reject_unknown_fields
from slackswap.metrics_table import names as metric_names

RECORD_FILE = "run_record.json"


class RunStatus(StrEnum):
    #: The plan fits the budget and was simulated.
    OK = "ok"
    #: The planner raised InfeasibleBudgetError, static memory fills the device, or the simulator found
    #: the plan does not fit: a result, not a crash.
    INFEASIBLE = "infeasible"
    #: Any other exception (a bad config value, a bug, a solver failure, MLflow unreachable).
    FAILED = "failed"
    #: Interrupted (SIGINT / SIGTERM) while it ran; the MLflow run is KILLED.
    KILLED = "killed"


#: Outcomes that are results of the experiment (a re-run of the sweep keeps them).
FINISHED_STATUSES = (RunStatus.OK, RunStatus.INFEASIBLE)


@dataclass(frozen=True)
class RunRecord:
    run_name: str
    choices: Mapping[str, str]
    model: str | None
    hardware: str | None
    #: The preset name, qualified when a sweep overrides `planner.name` of one preset.
    planner: str
    planner_name: str
    budget_fraction: float | None
    budget_bytes_requested: int | None
    run_dir: str
    mlflow_run_id: str | None = None
    #: None only while the job runs.
    status: RunStatus | None = None
    failure_reason: str = ""
    #: metrics.json of the run (slackswap.experiment.run.run_metrics builds it).
    metrics: Mapping[str, Any] = field(default_factory=dict)
    #: Human-readable facts for the printed summary (swapped / recomputed tensors, ...).
    facts: Mapping[str, Any] = field(default_factory=dict)
    #: Wall-clock seconds per stage, filled in place as the job goes, so a job that fails midway
    #: still says where its time went.
    timings_s: dict[str, float] = field(default_factory=dict)
    #: Versions the job ran with (python, numpy, ..., the slackswap commit): `pipelines.provenance`.
    versions: Mapping[str, str] = field(default_factory=dict)
    #: The job's folder name in a sweep directory: set when a sweep's records are read, never written.
    job: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["job"]
        out["status"] = None if self.status is None else self.status.value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], job: str = "") -> RunRecord:
        """Inverse of `to_dict`. An unknown field, a missing field without a default or an unknown
        status is a ConfigError naming it."""
        written = [f for f in fields(cls) if f.name != "job"]
        reject_unknown_fields("run_record", data, [f.name for f in written])
        required = [f.name for f in written if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ConfigError("run_record", missing, "missing field(s)")
        _check_types(data)
        status = data.get("status")
        if status is not None:
            try:
                status = RunStatus(status)
            except ValueError:
                known = [s.value for s in RunStatus]
                raise ConfigError("run_record.status", status, f"must be one of {known}") from None
        return cls(**{**data, "status": status, "job": job})

    def check_numbers(self, names: Iterable[str]) -> None:
        """Each metric of `names` the record has is a number, a boolean or null (but the metrics that are
        text by design: kind "text" in `slackswap.metrics_table`, such as the node or why a plan is
        infeasible); else a ConfigError naming the field and its value (a hand-edited `"step_s": "0.5"`
        would crash the summary's arithmetic far from the file)."""
        text = set(metric_names(kind="text"))
        for name in (n for n in names if n not in text):
            value = self.metrics.get(name)
            if value is not None and not isinstance(value, (bool, int, float)):
                raise ConfigError(f"run_record.metrics.{name}", value, "must be a number")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str) + "\n"

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / RECORD_FILE
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, path: Path, job: str = "") -> RunRecord:
        """The record in `path`; a file that is not one (truncated, hand-edited) is a ValueError
        naming the path."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: a run record is a JSON object, not {type(data).__name__}")
        return cls.from_dict(data, job=job)


#: The JSON types of the record's fields: valid JSON with a wrong field (`"metrics": null`, a list for
#: `choices`) is refused naming the field, not met later as an AttributeError in the summary.
_MAPPING_FIELDS = ("choices", "metrics", "facts", "timings_s", "versions")
_TEXT_FIELDS = ("run_name", "planner", "planner_name", "run_dir", "failure_reason")
_OPTIONAL_TEXT_FIELDS = ("model", "hardware", "mlflow_run_id", "status")
_OPTIONAL_NUMBER_FIELDS = ("budget_fraction", "budget_bytes_requested")


def _check_types(data: Mapping[str, Any]) -> None:
    for name in _MAPPING_FIELDS:
        if name in data and not isinstance(data[name], Mapping):
            raise ConfigError(f"run_record.{name}", data[name], "must be a JSON object")
    for name in _TEXT_FIELDS + _OPTIONAL_TEXT_FIELDS:
        value = data.get(name)
        if name in data and not isinstance(value, str) and not (value is None and name in _OPTIONAL_TEXT_FIELDS):
            raise ConfigError(f"run_record.{name}", value, "must be a string")
    for name in _OPTIONAL_NUMBER_FIELDS:
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"run_record.{name}", value, "must be a number or null")
    for key, value in (data.get("metrics") or {}).items():
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ConfigError(f"run_record.metrics.{key}", value, "must be a number, a boolean, a string or null")
