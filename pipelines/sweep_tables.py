"""The sweep's markdown tables: summary.md and paper_table.md, from the summary frame of
`pipelines.aggregate` (one row per job, the columns of the metrics table's summary metrics).

Pure functions of the frame: what a cell shows ("-" for unknown, GiB, percent, points) is decided
here, the numbers come from the jobs' records.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from pipelines.records import RECORD_FILE, RunStatus


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
