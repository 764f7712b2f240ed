"""The sweep's two plots: throughput retained against the budget, and planners side by side.

Drawn from the summary frame of `pipelines.aggregate` (one row per job); each planner keeps one fixed
look (colour, marker, line) from plot to plot. matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from pipelines.records import RunStatus


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
