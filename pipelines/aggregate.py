"""Aggregate a finished sweep: summary.csv / summary.md, plots, and the paper table.

This module reads the records into the summary frame and writes the files; the markdown tables are
`pipelines.sweep_tables`, the plots `pipelines.sweep_plots`. The metric columns are the summary
metrics of `slackswap.metrics_table`.

Reads the `run_record.json` each job wrote into its folder of the sweep directory (Hydra's
`on_multirun_end` gets no job results). Files are the source rather than MLflow, so aggregation also
works with `tracking=off`, and a job that failed still contributes its row with its reason.

Whatever the folder holds, the summary says what it covers: `4 of 10 jobs: 4 ok; 6 missing` when
jobs have no record (an interrupted sweep, or one still running), one line naming each record that
cannot be read (truncated by a full disk, say) while the good ones are summarised, and one column per
key the sweep varies beyond model, hardware, planner and budget (`model.micro_batch_size`), from the
jobs' `.hydra/overrides.yaml`. Files that cannot be written (a full disk) are reported, not raised:
the summary is still returned for the caller to print.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from pipelines.modern_table import FILE_NAME as WORKLOAD_TABLE_FILE
from pipelines.modern_table import workload_table
from pipelines.progress import read_progress
from pipelines.records import RECORD_FILE, RunRecord
from pipelines.sweep_plots import plot_planner_comparison, plot_throughput_vs_budget
from pipelines.sweep_tables import paper_table, summary_markdown
from slackswap.metrics_table import names as metric_names


def metric_columns() -> tuple[str, ...]:
    """The summary's metric columns: the summary metrics of `slackswap.metrics_table`, in its order
    (read when a sweep is aggregated, so a metric added to the table is a column with no edit here)."""
    return metric_names(summary=True)


#: Rows that share these simulated the same graph on the same hardware at the same budget, so a lower
#: bound on step time from any of them (the milp planner's) bounds every plan among them. The keep-all
#: figures are part of the key because a sweep may override model fields under one preset name; the
#: per-GPU link rates because one hardware preset on two nodes is two problems.
SAME_PROBLEM = ["model", "hardware", "keep_all_peak_bytes", "ideal_step_s", "budget_bytes",
                "effective_h2d_gbps", "effective_d2h_gbps"]


@dataclass(frozen=True)
class AggregateResult:
    table: pd.DataFrame
    files: tuple[Path, ...]
    summary_md: str
    paper_table_md: str
    status_counts: Mapping[str, int]
    #: Jobs of the sweep (sweep_progress.json) with no record; 0 when the count is unknown.
    missing: int = 0
    #: One line per record that could not be read, and per file that could not be written.
    problems: tuple[str, ...] = ()
    records: tuple[RunRecord, ...] = ()
    #: The file `paper_table_md` was written to: paper_table.md, or the workload table of an experiment
    #: without published figures (`experiment.workload_table`, pipelines/modern_table.py).
    results_file: str = "paper_table.md"


@dataclass(frozen=True)
class Records:
    """The records of a sweep folder, and one line per record file that cannot be read."""

    records: list[RunRecord]
    unreadable: list[str] = field(default_factory=list)


def read_records(sweep_dir: Path, known: Mapping[str, RunRecord] | None = None) -> Records:
    """Every job's record; a file that is not a valid record is named in `unreadable` (and left out),
    unless `known` (the records this process holds in memory, by job folder name) has that job's."""
    known = dict(known or {})
    paths = sorted(sweep_dir.glob(f"*/{RECORD_FILE}"), key=lambda p: _job_sort_key(p.parent.name))
    records: dict[str, RunRecord] = {}
    unreadable: list[str] = []
    for path in paths:
        job = path.parent.name
        try:
            record = RunRecord.read(path, job=job)
            record.check_numbers(metric_columns())
            records[job] = record
        except (ValueError, OSError) as exc:  # JSONDecodeError and ConfigError are ValueErrors
            if job in known:
                continue
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            unreadable.append(f"{path}: unreadable ({type(exc).__name__}: {why})")
    for job, record in known.items():  # a record that never reached the disk (full disk)
        records.setdefault(job, replace(record, job=job))
    ordered = [records[job] for job in sorted(records, key=_job_sort_key)]
    return Records(ordered, unreadable)


def load_records(sweep_dir: Path, known: Mapping[str, RunRecord] | None = None) -> list[RunRecord]:
    return read_records(sweep_dir, known).records


#: Sweep keys shown by the existing columns (model, hardware, planner, budget share).
_COLUMN_KEYS = frozenset({"model", "hardware", "planner", "planner.name", "budget.fraction", "budget.bytes", "budget"})


def swept_values(sweep_dir: Path, jobs: Sequence[str]) -> dict[str, dict[str, str]]:
    """{key: {job: value}} for every override key whose value differs between the jobs (from each
    job's `.hydra/overrides.yaml`), but the keys the table already shows."""
    import yaml

    per_job: dict[str, dict[str, str]] = {}
    for job in jobs:
        path = sweep_dir / job / ".hydra" / "overrides.yaml"
        try:
            overrides = yaml.safe_load(path.read_text()) or []
        except (OSError, yaml.YAMLError):
            continue
        values = {}
        for item in overrides:
            key, sep, value = str(item).partition("=")
            key = key.lstrip("+~")
            if sep and not key.startswith("hydra"):
                values[key] = value
        per_job[job] = values
    keys = sorted({k for values in per_job.values() for k in values} - _COLUMN_KEYS)
    out: dict[str, dict[str, str]] = {}
    for key in keys:
        column = {job: values.get(key, "") for job, values in per_job.items()}
        if len(set(column.values())) > 1:
            out[key] = column
    return out


def _job_sort_key(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def records_to_frame(
    records: Sequence[RunRecord], swept: Mapping[str, Mapping[str, str]] | None = None
) -> pd.DataFrame:
    """One row per record; `swept` ({key: {job: value}}) adds a column per swept key after planner."""
    swept = dict(swept or {})
    columns_m = metric_columns()
    rows = []
    for rec in records:
        m = rec.metrics
        row = {
            "job": rec.job,
            "model": rec.model,
            "hardware": rec.hardware,
            "planner": rec.planner,
            "budget_fraction": rec.budget_fraction,
            "budget_bytes_requested": rec.budget_bytes_requested,
            # Plain strings in the table (a RunStatus compares equal to its value).
            "status": "running" if rec.status is None else str(rec.status),
        }
        row |= {key: values.get(rec.job, "") for key, values in swept.items()}
        row |= {col: m.get(col) for col in columns_m}
        # The x axis of the curves: budget / keep-all peak, also defined for absolute-byte budgets.
        peak, budget = m.get("keep_all_peak_bytes"), m.get("budget_bytes")
        # Rounded so that one requested fraction is one group across models: budget_bytes is floored
        # to whole bytes, so the exact share differs by ~1e-10 from model to model.
        share = budget / peak if peak and budget is not None else rec.budget_fraction
        row["budget_share"] = None if share is None else round(share, 4)
        row["failure_reason"] = rec.failure_reason
        row["mlflow_run_id"] = rec.mlflow_run_id
        rows.append(row)
    columns = ["job", "model", "hardware", "planner", *swept, "budget_fraction", "budget_bytes_requested", "status"]
    columns += [*columns_m, "budget_share", "failure_reason", "mlflow_run_id"]
    frame = pd.DataFrame(rows, columns=columns)
    frame = _with_gap_to_best_bound(frame)
    order = ["model", "hardware", "budget_share", "planner", *swept]
    frame = frame.sort_values(order, kind="stable").reset_index(drop=True)
    frame.attrs["swept"] = list(swept)
    return frame


def _with_gap_to_best_bound(frame: pd.DataFrame) -> pd.DataFrame:
    """Add `best_bound_s` (the largest lower bound any run of the same problem reported) and
    `gap_to_bound` = step_s / best_bound_s - 1 for every run with a step time: the distance to the
    optimum that the milp bound certifies, for every planner, not only for the one that computed it."""
    frame = frame.copy()
    bounds = pd.to_numeric(frame["bound_step_s"], errors="coerce")
    keys = ["|".join(map(repr, key)) for key in frame[SAME_PROBLEM].itertuples(index=False)]
    keyed = pd.Series(keys, index=frame.index)
    frame["best_bound_s"] = bounds.groupby(keyed).transform("max")
    step = pd.to_numeric(frame["step_s"], errors="coerce")
    frame["gap_to_bound"] = step / frame["best_bound_s"] - 1.0
    return frame


def aggregate_sweep(
    sweep_dir: Path,
    experiment: Mapping[str, Any],
    plots: bool = True,
    known: Mapping[str, RunRecord] | None = None,
) -> AggregateResult:
    """summary.csv, summary.md, paper_table.md (when the experiment has a reference) and, unless
    `plots` is False (`plots=none`), the two sweep plots.

    `known`: records this process holds in memory (by job folder), used where a job's file is missing
    or unreadable. A file that cannot be written is a line of `problems`, not an exception: the summary
    is returned all the same."""
    found = read_records(sweep_dir, known)
    records = found.records
    if not records:
        why = "; ".join(found.unreadable) if found.unreadable else "no job of this sweep finished"
        raise RuntimeError(f"no readable {RECORD_FILE} under {sweep_dir}/*/: {why}")
    progress = _read_progress_quietly(sweep_dir)
    total = progress.get("total") if progress else None
    frame = records_to_frame(records, swept_values(sweep_dir, [r.job for r in records]))
    problems = list(found.unreadable)
    summary_md = summary_markdown(frame, total, found.unreadable)
    files: list[Path] = []

    def write(path: Path, produce: Any) -> None:
        try:
            produce(path)
            files.append(path)
        except OSError as exc:
            from pipelines.faults import os_error_line

            path.unlink(missing_ok=True)  # no truncated file beside the others
            problems.append(f"{path.name} not written: {os_error_line(exc)}")

    write(sweep_dir / "summary.csv", lambda path: frame.to_csv(path, index=False))
    write(sweep_dir / "summary.md", lambda path: path.write_text(summary_md))
    curve = sweep_dir / "throughput_vs_budget.png"
    if plots and frame["budget_share"].nunique(dropna=True) >= 2:
        write(curve, lambda path: plot_throughput_vs_budget(frame, path))
    else:
        # One budget gives one point per line: planner_comparison.png shows the same numbers as bars.
        # A stale curve from an earlier run of this folder would contradict the summary, so it goes.
        curve.unlink(missing_ok=True)
    if plots:
        write(sweep_dir / "planner_comparison.png", lambda path: plot_planner_comparison(frame, path))
    paper_md, results_file = paper_table(frame, experiment), "paper_table.md"
    if not paper_md:
        paper_md, results_file = workload_table(frame, experiment), WORKLOAD_TABLE_FILE
    if paper_md:
        write(sweep_dir / results_file, lambda path: path.write_text(paper_md))
    missing = max(0, total - len(records)) if isinstance(total, int) else 0
    counts = dict(Counter(frame["status"]))
    return AggregateResult(
        frame, tuple(files), summary_md, paper_md, counts, missing, tuple(problems), tuple(records), results_file
    )


def _read_progress_quietly(sweep_dir: Path) -> Mapping[str, Any] | None:
    try:
        return read_progress(sweep_dir)
    except (OSError, json.JSONDecodeError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pipelines.aggregate <sweep_dir>`: summarise any sweep folder, complete or partial
    (an interrupted sweep, or one still running), from the jobs' run_record.json files. MLflow is not
    touched: the folder is the source."""
    import argparse
    import sys

    import yaml

    parser = argparse.ArgumentParser(prog="python -m pipelines.aggregate", description=main.__doc__)
    parser.add_argument("sweep_dir", type=Path, help="a Hydra sweep folder (multirun/<date>/<time>)")
    args = parser.parse_args(argv)
    sweep_dir: Path = args.sweep_dir
    if not sweep_dir.is_dir():
        print(f"error: {sweep_dir} is not a folder", file=sys.stderr)
        return 2
    experiment: Mapping[str, Any] = {}
    multirun_yaml = sweep_dir / "multirun.yaml"
    if multirun_yaml.is_file():  # the paper table needs the experiment's reference figures
        try:
            experiment = (yaml.safe_load(multirun_yaml.read_text()) or {}).get("experiment") or {}
        except yaml.YAMLError as exc:
            print(f"error: {multirun_yaml}: not valid YAML ({str(exc).splitlines()[0]})", file=sys.stderr)
            return 2
    try:
        result = aggregate_sweep(sweep_dir, experiment)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result.summary_md)
    if result.paper_table_md:
        print(result.paper_table_md)
    print(f"aggregate: {', '.join(p.name for p in result.files)} -> {sweep_dir}")
    for line in result.problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if result.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
