"""Aggregate a finished sweep: summary.csv / summary.md, plots, and the paper table.

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
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from pipelines.progress import read_progress
from pipelines.records import RECORD_FILE, RunRecord, RunStatus

METRIC_COLUMNS = (
    "throughput_ratio",
    "step_s",
    "ideal_step_s",
    "peak_activation_bytes",
    "keep_all_peak_bytes",
    "budget_bytes",
    "recompute_s",
    "stall_s",
    "d2h_bytes",
    "h2d_bytes",
    "swapped_tensors",
    "recomputed_tensors",
    "plan_wall_s",
    "sim_wall_s",
    "feasible",
    "bound_step_s",
    "static_bytes",
    "headroom_bytes",
    "peak_reserved_bytes",
    "fragmentation_share",
    "fits_reserved",
    "tokens_per_s",
    "mfu",
    "fits_device",
    # the node (conf/node): what each GPU's host link really gave, and the same plan with the GPU alone
    "node",
    "gpus_per_node",
    "effective_h2d_gbps",
    "effective_d2h_gbps",
    "h2d_limit",
    "alone_throughput_ratio",
)

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
            record.check_numbers(METRIC_COLUMNS)
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
        row |= {col: m.get(col) for col in METRIC_COLUMNS}
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
    columns += [*METRIC_COLUMNS, "budget_share", "failure_reason", "mlflow_run_id"]
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


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "gap":
        return f"+{value:.2%}" if value >= 0 else f"{value:.2%}"
    if kind == "gib":
        return f"{value / 2**30:.3g}"
    if kind == "s":
        return f"{value:.4f}"
    if kind == "int":
        return f"{int(value)}"
    if kind == "rate":
        return f"{value:,.0f}"
    return str(value)


def _fmt_fit(value: Any) -> str:
    """The device verdict: "yes", "**NO**" (a run that meets its budget but not the device stands
    out), "-" where there is no plan to judge."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return "yes" if bool(value) else "**NO**"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def summary_markdown(
    frame: pd.DataFrame, total: int | None = None, problems: Sequence[str] = ()
) -> str:
    """The summary table; its first line says how many of the sweep's `total` jobs it covers."""
    swept = list(frame.attrs.get("swept", []))
    header = [
        "model", "hardware", "budget", "planner", *swept, "status", "throughput", "gap to bound", "step s",
        "peak GiB", "budget GiB", "swapped", "recomputed", "stall s", "tokens/s", "MFU", "fits device", "reason",
    ]  # fmt: skip
    rows = [
        [
            str(r["model"]),
            str(r["hardware"]),
            _fmt(r["budget_share"], "pct"),
            str(r["planner"]),
            *[str(r[key]) for key in swept],
            str(r["status"]),
            _fmt(r["throughput_ratio"], "pct"),
            _fmt(r["gap_to_bound"], "gap"),
            _fmt(r["step_s"], "s"),
            _fmt(r["peak_activation_bytes"], "gib"),
            _fmt(r["budget_bytes"], "gib"),
            _fmt(r["swapped_tensors"], "int"),
            _fmt(r["recomputed_tensors"], "int"),
            _fmt(r["stall_s"], "s"),
            _fmt(r["tokens_per_s"], "rate"),
            _fmt(r["mfu"], "pct"),
            _fmt_fit(r["fits_device"]),
            str(r["failure_reason"] or ""),
        ]  # fmt: skip
        for _, r in frame.iterrows()
    ]
    counts = Counter(frame["status"])
    shown = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    if total is not None and total > len(frame):
        head = f"{len(frame)} of {total} jobs: {shown}; {total - len(frame)} missing (no {RECORD_FILE})"
    else:
        head = f"{len(frame)} jobs: {shown}"
    over = int(((frame["status"] == RunStatus.OK) & (frame["fits_device"] == False)).sum())  # noqa: E712
    if over:
        head += f"; {over} of the ok runs DO NOT FIT THE DEVICE (peak + static + reserve over its memory)"
    notes = "".join(f"\n- {line}" for line in problems)
    return f"# Sweep summary\n\n{head}{notes}\n\n" + markdown_table(header, rows)


def paper_table(frame: pd.DataFrame, experiment: Mapping[str, Any]) -> str:
    """Paper against ours, per model of `experiment.paper_reference`, with the delta in points."""
    reference = experiment.get("paper_reference") or {}
    if not reference:
        return ""
    ours_planner = experiment.get("paper_planner", "slackswap")
    header = [
        "model",
        "hardware",
        "budget",
        "paper",
        f"ours ({ours_planner})",
        "delta (pp)",
        "gap to optimum",
        "reserved peak GiB (fits)",
        "best other planner",
        "status",
    ]
    rows = []
    for model, paper_value in reference.items():
        mine = frame[(frame["model"] == model) & (frame["planner"] == ours_planner)]
        if mine.empty:
            rows.append([model, "-", "-", _fmt(paper_value, "pct"), "not run", "-", "-", "-", "-", "missing"])
            continue
        for r in mine.itertuples():
            others = frame[
                (frame["model"] == model)
                & (frame["hardware"] == r.hardware)
                & (frame["budget_share"] == r.budget_share)
                & (frame["planner"] != ours_planner)
                & (frame["status"] == RunStatus.OK)
            ]
            if others.empty:
                best = "-"
            else:
                top = others.loc[others["throughput_ratio"].idxmax()]
                best = f"{top['throughput_ratio']:.1%} ({top['planner']})"
            ok = r.status == RunStatus.OK
            delta = f"{(r.throughput_ratio - paper_value) * 100:+.1f}" if ok else "-"
            status = r.status if ok else f"{r.status}: {r.failure_reason}"
            rows.append(
                [
                    model,
                    str(r.hardware),
                    _fmt(r.budget_share, "pct"),
                    _fmt(paper_value, "pct"),
                    _fmt(r.throughput_ratio, "pct") if ok else "-",
                    delta,
                    _fmt(r.gap_to_bound, "gap") if ok else "-",
                    _reserved_cell(r) if ok else "-",
                    best,
                    status,
                ]  # fmt: skip
            )
    title = "# Paper vs ours: throughput retained at the paper's activation budget\n\n"
    note = (
        f"\nPaper: {experiment.get('paper_source') or 'see conf/experiment'}. Ours: simulated with this "
        "repository's profile, planner and simulator; every assumption is in the resolved config of each run. "
        "Gap to optimum: step time over the best lower bound on step time reported for the same problem "
        "(the milp planner's `bound_step_s`), minus one; '-' where no bound was computed.\n"
    )
    tables = markdown_table(header, rows) + note + _fragmentation_note(frame[frame["model"].isin(list(reference))])
    return title + tables + _planner_margins(frame, list(reference), ours_planner) + _node_section(
        frame[frame["model"].isin(list(reference))]
    )


def _node_section(frame: pd.DataFrame) -> str:
    """On a node whose GPUs share the host link: each planner's figure there against the same planner
    and budget with the GPU alone, and the link rate each GPU really got. Empty when nothing is shared."""
    shared = frame[pd.to_numeric(frame["gpus_per_node"], errors="coerce") > 1]
    if shared.empty:
        return ""
    workloads = sorted({(r.model, r.hardware) for r in shared.itertuples()}, key=str)
    header = ["planner", *[f"{m} ({h})" for m, h in workloads]]
    rows = []
    for planner in sorted(shared["planner"].unique()):
        cells = [planner]
        for model, hardware in workloads:
            hit = shared[(shared["planner"] == planner) & (shared["model"] == model) & (shared["hardware"] == hardware)]
            if hit.empty:
                cells.append("not run")
                continue
            r = hit.iloc[0]
            alone = r["alone_throughput_ratio"]
            here = _fmt(r["throughput_ratio"], "pct") if r["status"] == RunStatus.OK else str(r["status"])
            if alone is None or (isinstance(alone, float) and math.isnan(alone)):
                cells.append(f"{here} (alone: infeasible or not run)")
            elif r["status"] == RunStatus.OK:
                cells.append(f"{here} (alone {_fmt(alone, 'pct')}, {(r['throughput_ratio'] - alone) * 100:+.1f} pp)")
            else:
                cells.append(f"{here} (alone {_fmt(alone, 'pct')})")
        rows.append(cells)
    first = shared.iloc[0]
    link = (
        f"Node `{first['node']}`: {int(first['gpus_per_node'])} GPUs in lockstep; each GPU's host link gave "
        f"H2D {first['effective_h2d_gbps']:.2f} GB/s and D2H {first['effective_d2h_gbps']:.2f} GB/s "
        f"(`effective_h2d_gbps`, `effective_d2h_gbps`; H2D limited by {first['h2d_limit']}). 'alone': the same "
        "planner and budget with the GPU alone on its preset link (docs/hardware.md, \"Shared host links\").\n"
    )
    return "\n## On the node: every planner with the host link shared\n\n" + link + "\n" + markdown_table(header, rows)


def _reserved_cell(r: Any) -> str:
    """Reserved peak of the caching-allocator model and whether it fits the budget; '-' when not modelled."""
    reserved = getattr(r, "peak_reserved_bytes", None)
    if reserved is None or (isinstance(reserved, float) and math.isnan(reserved)):
        return "-"
    fits = "fits" if bool(r.fits_reserved) else "over budget"
    return f"{_fmt(reserved, 'gib')} ({fits}, {r.fragmentation_share:.1%} fragmentation)"


def _fragmentation_note(frame: pd.DataFrame) -> str:
    """How many of the plans that fit byte-exactly still fit once the caching allocator is counted."""
    ok = frame[(frame["status"] == RunStatus.OK) & frame["fits_reserved"].notna()]
    if ok.empty:
        return ""
    still = int(ok["fits_reserved"].astype(bool).sum())
    rest = "" if still == len(ok) else "; the others' reserved peak exceeds the budget"
    return (
        f"\nOnce fragmentation is counted (simulate.allocator=caching: PyTorch's caching allocator, "
        f"docs/memory.md), {still} of the {len(ok)} plans that fit their budget byte-exactly "
        f"({still / len(ok):.0%}) still fit{rest}.\n"
    )


def _planner_margins(frame: pd.DataFrame, models: Sequence[str], ours_planner: str) -> str:
    """Every planner's throughput per model at the paper's budget, and its margin to ours in points."""
    sub = frame[frame["model"].isin(models)]
    if sub.empty:
        return ""
    ours = {
        (r.model, r.hardware, r.budget_share): r.throughput_ratio
        for r in sub[(sub["planner"] == ours_planner) & (sub["status"] == RunStatus.OK)].itertuples()
    }
    workloads = sorted({(r.model, r.hardware, r.budget_share) for r in sub.itertuples()}, key=str)
    header = ["planner", *[f"{m} ({h}, {b:.0%})" for m, h, b in workloads]]
    rows = []
    for planner in sorted(sub["planner"].unique(), key=lambda p: (p != ours_planner, p)):
        cells = [planner]
        for model, hardware, budget in workloads:
            hit = sub[
                (sub["planner"] == planner)
                & (sub["model"] == model)
                & (sub["hardware"] == hardware)
                & (sub["budget_share"] == budget)
            ]
            if hit.empty:
                cells.append("not run")
                continue
            r = hit.iloc[0]
            if r["status"] != RunStatus.OK:
                cells.append(str(r["status"]))
                continue
            cell = _fmt(r["throughput_ratio"], "pct")
            mine = ours.get((model, hardware, budget))
            if planner != ours_planner and mine is not None:
                cell += f" ({(r['throughput_ratio'] - mine) * 100:+.1f} pp vs {ours_planner})"
            if not math.isnan(r["gap_to_bound"]):
                cell += f", gap {_fmt(r['gap_to_bound'], 'gap')}"
            cells.append(cell)
        rows.append(cells)
    return "\n## Every planner at the paper's budget\n\n" + markdown_table(header, rows)


@dataclass(frozen=True)
class PlannerStyle:
    color: str
    marker: str
    linestyle: str = "-"
    #: Bars: milp's certified plan is hatched so it reads apart from the heuristics beside it.
    hatch: str = ""
    #: Drawn above the others (milp's line often lies on slackswap's).
    zorder: float = 2.0


#: One fixed look per shipped planner preset: a planner keeps its colour and marker from plot to plot,
#: and no two share one (a 10-colour cycle gave capuchin and swap_only the same colour once the
#: eleventh planner came). milp is dashed with open markers on top, so the line under it shows.
PLANNER_STYLES: dict[str, PlannerStyle] = {
    "slackswap": PlannerStyle("#1f77b4", "o"),
    "milp": PlannerStyle("#000000", "D", "--", hatch="//", zorder=3.0),
    "capuchin": PlannerStyle("#ff7f0e", "s"),
    "swap_only": PlannerStyle("#2ca02c", "^"),
    "recompute_knapsack": PlannerStyle("#d62728", "v"),
    "selective_recompute": PlannerStyle("#9467bd", "P"),
    "full_recompute": PlannerStyle("#8c564b", "X"),
    "full_recompute_sqrt": PlannerStyle("#e377c2", "<"),
    "dtr": PlannerStyle("#7f7f7f", ">"),
    "memo": PlannerStyle("#bcbd22", "h"),
    "keep_all": PlannerStyle("#17becf", "*"),
    "slackswap_seed": PlannerStyle("#9edae5", "p", ":"),
    "torch_sac": PlannerStyle("#393b79", "d"),
    "torch_sac_no_core": PlannerStyle("#6b6ecf", "H", ":"),
    "torch_budget": PlannerStyle("#637939", "8"),
}
#: Planners without a fixed style (a user's, or a qualified `preset[name]` label not in the table):
#: colours and markers no fixed style uses, by sorted position.
_EXTRA_COLORS = ("#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39", "#ad494a", "#3182bd")
_EXTRA_MARKERS = ("1", "2", "3", "4", "+", "|", "_", ".")


def planner_styles(planners: Sequence[str]) -> dict[str, PlannerStyle]:
    """A distinct style for each planner label: the fixed one of its preset, else the next unused."""
    styles: dict[str, PlannerStyle] = {}
    extra = 0
    for label in sorted(planners):
        fixed = PLANNER_STYLES.get(label) or PLANNER_STYLES.get(label.split("[", 1)[0])
        if fixed is not None and fixed not in styles.values():
            styles[label] = fixed
            continue
        styles[label] = PlannerStyle(
            _EXTRA_COLORS[extra % len(_EXTRA_COLORS)],
            _EXTRA_MARKERS[extra % len(_EXTRA_MARKERS)],
            ("-", "-.", ":")[(extra // len(_EXTRA_COLORS)) % 3],
        )
        extra += 1
    return styles


def plot_throughput_vs_budget(frame: pd.DataFrame, path: Path) -> None:
    """One panel per (model, hardware); a line per planner; infeasible budgets marked x on the axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    percent = PercentFormatter(xmax=1.0, decimals=0)
    panels = list(frame.groupby(["model", "hardware"], sort=True))
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(max(9.0, 5.0 * cols), 3.6 * rows + 1.2), squeeze=False, layout="constrained"
    )
    planners = sorted(frame["planner"].unique())
    styles = planner_styles(planners)
    for ax, ((model, hardware), sub) in zip(axes.flat, panels, strict=False):
        # Zoom on the feasible ratios (planners differ by a few points); infeasible runs sit on the floor.
        ok_ratios = pd.to_numeric(sub.loc[sub["status"] == RunStatus.OK, "throughput_ratio"], errors="coerce").dropna()
        floor = max(0.0, math.floor((ok_ratios.min() if len(ok_ratios) else 0.0) * 20 - 1) / 20)
        for planner, rows_p in sub.groupby("planner", sort=True):
            ok = rows_p[rows_p["status"] == RunStatus.OK].sort_values("budget_share")
            bad = rows_p[rows_p["status"] != RunStatus.OK]
            style = styles[planner]
            ax.plot(
                ok["budget_share"], ok["throughput_ratio"], color=style.color, marker=style.marker,
                linestyle=style.linestyle, label=planner, ms=6 if style.zorder > 2 else 4, zorder=style.zorder,
                markerfacecolor="none" if style.zorder > 2 else style.color,
            )  # fmt: skip
            ax.plot(bad["budget_share"], [floor] * len(bad), "x", color=style.color, ms=7, zorder=style.zorder)
        ax.set_title(f"{model} on {hardware}", fontsize=10)
        ax.set_xlabel("activation budget (% of the keep-all peak)")
        ax.set_ylabel("throughput retained (% of ideal)")
        ax.set_ylim(floor, 1.01)
        ax.xaxis.set_major_formatter(percent)
        ax.yaxis.set_major_formatter(percent)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles = [
        plt.Line2D(
            [], [], color=styles[p].color, marker=styles[p].marker, linestyle=styles[p].linestyle, label=p,
            markerfacecolor="none" if styles[p].zorder > 2 else styles[p].color,
        )
        for p in planners
    ]  # fmt: skip
    fig.legend(handles=handles, loc="outside lower center", ncol=min(5, len(planners)), fontsize=8)
    fig.suptitle("Throughput retained vs activation budget (x on the bottom axis: infeasible or failed)", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_planner_comparison(frame: pd.DataFrame, path: Path) -> None:
    """One panel per budget; grouped bars: workloads on x, one bar per planner (missing bar: not ok)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    percent = PercentFormatter(xmax=1.0, decimals=0)
    budgets = sorted(frame["budget_share"].dropna().unique())
    planners = sorted(frame["planner"].unique())
    styles = planner_styles(planners)
    n_workloads = frame.groupby(["model", "hardware"]).ngroups
    figsize = (max(8.0, 0.3 * n_workloads * len(planners) + 3.0), 3.2 * len(budgets))
    fig, axes = plt.subplots(len(budgets), 1, figsize=figsize, squeeze=False)
    width = 0.8 / max(1, len(planners))
    for ax, budget in zip(axes.flat, budgets, strict=True):
        sub = frame[frame["budget_share"] == budget]
        workloads = sorted({(m, h) for m, h in zip(sub["model"], sub["hardware"], strict=True)})
        for i, planner in enumerate(planners):
            heights = []
            for model, hardware in workloads:
                hit = sub[(sub["model"] == model) & (sub["hardware"] == hardware) & (sub["planner"] == planner)]
                heights.append(
                    float(hit["throughput_ratio"].iloc[0])
                    if len(hit) and hit["status"].iloc[0] == RunStatus.OK
                    else math.nan
                )
            xs = [j + (i - (len(planners) - 1) / 2) * width for j in range(len(workloads))]
            style = styles[planner]
            ax.bar(xs, heights, width=width, label=planner, color=style.color, hatch=style.hatch,
                   edgecolor="white" if style.hatch else None)  # fmt: skip
        ax.set_xticks(range(len(workloads)), [f"{m}\n{h}" for m, h in workloads], fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("throughput retained (% of ideal)")
        ax.yaxis.set_major_formatter(percent)
        ax.set_title(f"budget = {budget:.0%} of keep-all peak (no bar: infeasible or failed)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    paper_md = paper_table(frame, experiment)
    if paper_md:
        write(sweep_dir / "paper_table.md", lambda path: path.write_text(paper_md))
    missing = max(0, total - len(records)) if isinstance(total, int) else 0
    counts = dict(Counter(frame["status"]))
    return AggregateResult(
        frame, tuple(files), summary_md, paper_md, counts, missing, tuple(problems), tuple(records)
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
