"""Which pictures a job draws (`plots` config key) and the run's timeline.png."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slackswap.errors import ConfigError
from slackswap.experiment import RunOutcome, RunSpec

PLOT_LEVELS: tuple[str, ...] = ("auto", "all", "summary", "none")


def plot_level(resolved: Mapping[str, Any], multirun: bool) -> str:
    """The effective `plots` level of a job: "all", "summary" or "none" ("auto" depends on the mode)."""
    level = resolved.get("plots", "auto")
    if level not in PLOT_LEVELS:
        raise ConfigError("plots", level, f"must be one of {', '.join(PLOT_LEVELS)}")
    if level == "auto":
        return "summary" if multirun else "all"
    return level


def timeline_title(spec: RunSpec, budget_bytes: int, keep_all_peak_bytes: int) -> str:
    """Model, hardware, planner and budget, the four things that make one timeline differ from another."""
    share = budget_bytes / keep_all_peak_bytes if keep_all_peak_bytes else float("nan")
    return (
        f"{spec.model.name} on {spec.hardware.name}, planner {spec.planner_name}, "
        f"budget {budget_bytes / 2**30:.3g} GiB ({share:.0%} of the keep-all peak)"
    )


def draw_timeline(spec: RunSpec, outcome: RunOutcome, run_dir: Path, timings: dict[str, float]) -> None:
    """timeline.png of a simulated run (nothing for a run with no simulation)."""
    if outcome.result is None:
        return
    from pipelines.heavy_imports import import_paused

    t0 = time.perf_counter()
    import_paused("matplotlib.figure")  # what write_timeline_png draws with
    import_paused("matplotlib.backends.backend_agg")
    from slackswap.simulate.timeline import write_timeline_png

    title = timeline_title(spec, outcome.budget_bytes, outcome.baseline.keep_all_peak_bytes)
    write_timeline_png(outcome.result, run_dir / "timeline.png", outcome.budget_bytes, title=title)
    timings["write_timeline_s"] = time.perf_counter() - t0
