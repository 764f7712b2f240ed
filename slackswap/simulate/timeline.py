"""timeline.png: the three streams as lanes and device activation memory against the budget line.

matplotlib (Agg backend) is imported only when a figure is written, so the library stays importable
and fast without it. A 48-layer step has thousands of events; intervals of one lane and kind closer
than ~1/3000 of the step are merged before drawing (they are narrower than a pixel anyway), which
keeps the file small and the render fast without hiding any visible gap.
"""

from __future__ import annotations

from pathlib import Path

from slackswap.simulate.result import SimResult

_LANES = (("compute", "run"), ("compute", "recompute"), ("d2h", "offload"), ("h2d", "prefetch"))
_COLORS = {"run": "#4C72B0", "recompute": "#DD8452", "offload": "#55A868", "prefetch": "#8172B3"}
_ROW = {"compute": 2, "d2h": 1, "h2d": 0}


def merged_intervals(intervals: list[tuple[float, float]], min_gap_s: float) -> list[tuple[float, float]]:
    """Union of intervals, also bridging gaps shorter than `min_gap_s`."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start - out[-1][1] <= min_gap_s:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _byte_unit(max_bytes: float) -> tuple[str, float]:
    for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= scale:
            return name, scale
    return "bytes", 1.0


def write_timeline_png(
    result: SimResult, path: str | Path, budget_bytes: int | None, title: str | None = None
) -> Path:
    """`title`: what the figure shows (model, hardware, planner, budget); a PNG copied out of its run
    folder must still say where it came from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    span = max(result.end_s, 1e-12)
    min_gap = span / 3000
    fig, (ax_s, ax_m) = plt.subplots(
        2, 1, figsize=(14, 6.5), sharex=True, gridspec_kw={"height_ratios": [1, 1.4]}, constrained_layout=True
    )
    for stream, kind in _LANES:
        spans = [(e.start_s, e.end_s) for e in result.events if e.stream == stream and e.kind == kind]
        bars = [(a, max(b - a, min_gap / 2)) for a, b in merged_intervals(spans, min_gap)]
        ax_s.broken_barh(bars, (_ROW[stream] - 0.4, 0.8), facecolors=_COLORS[kind], linewidth=0)
    ax_s.set_yticks([0, 1, 2], ["h2d (prefetch)", "d2h (offload)", "compute"])
    ax_s.set_ylim(-0.6, 2.6)
    ax_s.legend(
        handles=[Patch(color=_COLORS[k], label=k) for k in _COLORS],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        title="busy",
        title_fontsize=8,
    )
    status = f"step {result.step_s:.4g} s" if result.feasible else f"INFEASIBLE at t={result.end_s:.4g} s"
    ax_s.set_title(
        f"{result.planner} ({len(result.events)} events): {status}; "
        f"stall {result.stall_s:.3g} s (prefetch {result.stall_prefetch_s:.3g} s, "
        f"memory {result.stall_memory_s:.3g} s); recompute {result.recompute_s:.3g} s",
        fontsize=10,
    )

    unit, scale = _byte_unit(max([result.peak_activation_bytes, budget_bytes or 0, 1]))
    times = list(result.memory_times_s) + [span]
    values = [b / scale for b in result.memory_bytes]
    values.append(values[-1])
    ax_m.step(times, values, where="post", color="#333333", linewidth=1.0, label="activation memory")
    ax_m.fill_between(times, values, step="post", color="#999999", alpha=0.3)
    if budget_bytes is not None:
        ax_m.axhline(
            budget_bytes / scale, color="#C44E52", linestyle="--", label=f"budget {budget_bytes / scale:.3g} {unit}"
        )
    ax_m.axhline(
        result.peak_activation_bytes / scale,
        color="#333333",
        linestyle=":",
        linewidth=0.8,
        label=f"peak {result.peak_activation_bytes / scale:.3g} {unit}",
    )
    ax_m.set_ylabel(f"device activation memory ({unit})")
    ax_m.set_xlabel("time (s)")
    ax_m.set_xlim(0, span)
    ax_m.set_ylim(bottom=0)
    ax_m.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
