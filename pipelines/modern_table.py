"""The workload table of a sweep over many jobs (`+experiment=modern`): one row per workload (model,
sequence length, platform), one column per planner, ours first.

Why a table of its own: the paper table compares one planner with a published figure per model; here
there is no published figure, and what a reader asks is how each baseline does beside slackswap on the
same rank's problem, and how far each is from the optimum the milp bound certifies. The `layout` column
names what one rank is (from the run's `parallel_*` metrics): a platform gives a dense and a
mixture-of-experts model different layouts on the same node (conf/platform), so the platform alone does
not say it. A cell is the
throughput retained, the margin to slackswap in points and the gap to the best bound of that problem
(`gap_to_bound`, pipelines/aggregate.py); a run without a plan shows its status (the reason is in
summary.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from pipelines.records import RunStatus
from pipelines.sweep_tables import _fmt, markdown_table

#: The file the table is written to, in the sweep folder and among the MLflow parent's artifacts.
FILE_NAME = "workload_table.md"
#: Swept keys that tell workloads of one model preset apart (the rest of the row key is model and hardware;
#: a platform names its node and layout, conf/platform).
WORKLOAD_KEYS = ("model.seq_len", "platform", "parallel")


def workload_table(frame: pd.DataFrame, experiment: Mapping[str, Any]) -> str:
    """Markdown for `experiment.workload_table` sweeps; "" for every other experiment."""
    if not experiment.get("workload_table") or frame.empty:
        return ""
    ours = experiment.get("paper_planner", "slackswap")
    keys = ["model", *[k for k in WORKLOAD_KEYS if k in frame.columns], "hardware"]
    planners = sorted(frame["planner"].unique(), key=lambda p: (p != ours, p))
    header = [*[k.removeprefix("model.") for k in keys], "layout", "keep-all GiB/rank", "budget GiB",
              "static GiB/rank", *planners]
    rows = []
    for key, group in frame.groupby(keys, sort=True):
        # The workload's figures from a run that has them (a failed run has no metrics).
        measured = group[group["keep_all_peak_bytes"].notna()]
        first = (measured if not measured.empty else group).iloc[0]
        mine = group[(group["planner"] == ours) & (group["status"] == RunStatus.OK)]
        mine_ratio = mine["throughput_ratio"].iloc[0] if not mine.empty else None
        cells = [str(k) for k in key] + [layout_label(first)]
        cells += [_gib(first["keep_all_peak_bytes"]), _gib(first["budget_bytes"]), _gib(first["static_bytes"])]
        for planner in planners:
            hit = group[group["planner"] == planner]
            cells.append(_cell(hit.iloc[0], planner != ours, mine_ratio) if not hit.empty else "not run")
        rows.append(cells)
    title = f"# Every planner beside {ours}, per workload (throughput retained at the budget per rank)\n\n"
    note = (
        f"\nA cell: throughput retained (step time over the ideal, keep-all step), the margin to {ours} in "
        "points, and `gap` = step time over the best lower bound on the same problem (the milp planner's "
        "`bound_step_s`) minus one: the distance to the optimum it certifies. layout: what one rank is (tp: "
        "tensor parallel, sp: sequence parallel, ep: expert parallel over dp data-parallel ranks). keep-all, "
        "budget and static are one rank's. Statuses and reasons of runs without a plan: summary.md.\n"
    )
    return title + markdown_table(header, rows) + note


#: The degrees a layout label names, in Megatron's order; a degree of 1 is left out.
LAYOUT_DEGREES = ("dp", "tp", "pp", "cp", "ep")


def layout_label(row: Mapping[str, Any]) -> str:
    """One rank's layout in a few characters: `tp8 sp`, `dp8 ep8`; `1 GPU` for one full replica (a run
    without a layout has no `parallel_*` metrics)."""
    parts = []
    for degree in LAYOUT_DEGREES:
        value = row.get(f"parallel_{degree}")
        if _present(value) and int(value) > 1:
            parts.append(f"{degree}{int(value)}")
    sp = row.get("parallel_sp")
    if _present(sp) and bool(sp) and parts:
        parts.append("sp")
    return " ".join(parts) or "1 GPU"


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _gib(value: Any) -> str:
    """GiB to three significant figures, whole GiB from 1,000 on (1,051 rather than 1.05e+03)."""
    if value is not None and not (isinstance(value, float) and math.isnan(value)) and value >= 1000 * 2**30:
        return f"{value / 2**30:,.0f}"
    return _fmt(value, "gib")


def _cell(r: pd.Series, beside: bool, mine: float | None) -> str:
    if r["status"] != RunStatus.OK:
        return str(r["status"])
    cell = _fmt(r["throughput_ratio"], "pct")
    if beside and mine is not None:
        cell += f" ({(r['throughput_ratio'] - mine) * 100:+.1f} pp)"
    gap = r["gap_to_bound"]
    if gap is not None and not (isinstance(gap, float) and math.isnan(gap)):
        cell += f", gap {_fmt(gap, 'gap')}"
    return cell
