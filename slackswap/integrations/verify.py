"""Predict, then verify: each verified step's measured figures against the plan's prediction, logged
to the trainer's own logger and, when the user runs one, to the active MLflow run.

Two quantities are judged, each with its own relative tolerance (`Tolerances`): the peak (the
runtime's ledger of every device storage of a graph tensor, the quantity the prediction counts) and
the step time. The step time is judged only where the plan's graph carries op times measured on this
device (`graph.meta["timing"] == "measured"`, `slackswap.profile.measured.retime`): a roofline step
time on a hardware preset predicts another device than the one the step runs on, so comparing it
with the wall clock here would be a miss every time; it is logged beside the measurement all the same.
A miss warns once per quantity for the run (a warning per step would bury the first one).

MLflow: the library never imports it. `active_mlflow_run` finds the module only if the user already
imported it (`sys.modules`) and a run is active; then the figures go there with the public
`mlflow.log_metrics`. A trainer whose own logger already reports to MLflow (HF's `MLflowCallback`,
Lightning's `MLFlowLogger`, Accelerate's mlflow tracker) gets them there once, through that logger.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass, fields
from types import ModuleType
from typing import TYPE_CHECKING

from slackswap.integrations.planning import IntegrationError

if TYPE_CHECKING:
    from slackswap.integrations.planning import StepPlan


@dataclass(frozen=True)
class Tolerances:
    """How far a verified step may be from the prediction before it is a miss."""

    #: Relative: a step misses when its measured peak exceeds predicted x (1 + peak_tolerance). The
    #: default 0 makes any byte over the prediction a miss (the runtime's ledger counts what the
    #: prediction counts, so on the tested models the two are equal to the byte).
    peak_tolerance: float = 0.0
    #: Relative: a step misses when |measured - predicted| / predicted step time exceeds it; judged
    #: only for a plan whose graph has measured op times (module docstring). 0.5: a verified step
    #: runs the runtime's ledger besides the step, and a shared machine's wall clock varies.
    step_tolerance: float = 0.5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise IntegrationError(f.name, value, "must be a finite number >= 0 (a relative tolerance)")


def active_mlflow_run() -> ModuleType | None:
    """The `mlflow` module when the user imported it and a run is active; never imports it."""
    mlflow = sys.modules.get("mlflow")
    active = getattr(mlflow, "active_run", None)
    if mlflow is None or active is None or active() is None:
        return None
    return mlflow


def log_to_mlflow(figures: dict[str, float], step: int) -> bool:
    """`figures` into the active MLflow run at `step`; whether there was one."""
    mlflow = active_mlflow_run()
    if mlflow is None:
        return False
    mlflow.log_metrics({k: float(v) for k, v in figures.items()}, step=step)
    return True


class PeakCheck:
    """Each verified step's measured peak and step time against the prediction, within `tolerances`;
    warns once per quantity on a miss."""

    def __init__(self, planned: StepPlan, tolerances: Tolerances | None = None):
        self.planned = planned
        self.tolerances = tolerances or Tolerances()
        self.measured: list[int] = []
        #: The quantities that missed and have been warned about ("peak", "step").
        self.warned: set[str] = set()

    @property
    def judges_step_time(self) -> bool:
        """Whether the predicted step time is of this device (measured op times)."""
        return self.planned.graph.meta.get("timing") == "measured"

    def _miss(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(f"slackswap: {message} on {self.planned.graph.name}", stacklevel=3)

    def observe(self, measured_peak_bytes: int, step_s: float | None = None) -> dict[str, float]:
        """The figures of one verified step, for the trainer's logger."""
        self.measured.append(measured_peak_bytes)
        p, t = self.planned, self.tolerances
        peak_ok = measured_peak_bytes <= p.predicted_peak_bytes * (1 + t.peak_tolerance)
        if not peak_ok:
            self._miss("peak", f"measured peak {measured_peak_bytes} B exceeds the predicted "
                               f"{p.predicted_peak_bytes} B by more than peak_tolerance={t.peak_tolerance} "
                               f"(budget {p.budget_bytes} B)")
        figures = {"slackswap/predicted_peak_bytes": p.predicted_peak_bytes,
                   "slackswap/measured_peak_bytes": measured_peak_bytes,
                   "slackswap/budget_bytes": p.budget_bytes,
                   "slackswap/within_budget": float(measured_peak_bytes <= p.budget_bytes),
                   "slackswap/peak_as_predicted": float(peak_ok)}
        if step_s is not None:
            figures.update({"slackswap/step_s": step_s, "slackswap/predicted_step_s": p.predicted_step_s})
            if self.judges_step_time and p.predicted_step_s > 0:
                error = abs(step_s - p.predicted_step_s) / p.predicted_step_s
                figures["slackswap/step_relative_error"] = error
                if error > t.step_tolerance:
                    self._miss("step", f"step {step_s:.6f} s is {100 * error:.1f} % off the predicted "
                                       f"{p.predicted_step_s:.6f} s (step_tolerance={t.step_tolerance})")
        return figures
