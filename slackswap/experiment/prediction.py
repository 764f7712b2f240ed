"""Predict a plan's step on the machine at hand, to set beside the step measured there.

On a GPU the simulator already models the machine: ops on the compute stream, copies on their own
engines over the (measured) link. On the CPU the "device" and the host are one memory and the
runtime copies synchronously on the compute thread (`slackswap.runtime.copy_engines.CpuCopies`), so
nothing overlaps: the predicted step is the plan simulated on an instant link (its ops and
recomputes, every copy arrived when issued) plus each copy's measured time (`Machine.copy_s`:
latency + bytes / bandwidth). Nothing is skipped and nothing is fitted to the step it predicts.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.profile.machine import Machine


@dataclass(frozen=True)
class Prediction:
    step_s: float
    #: The simulator's step (on an instant link where copies are synchronous).
    simulated_s: float
    #: Seconds of synchronous copies added to it (0 where copies overlap compute).
    sync_copy_s: float
    copies: int
    #: Seconds of the eager export's selective-checkpoint dispatch added to it (`predict_export`; 0 otherwise).
    dispatch_s: float = 0.0


def predict_step(graph: Graph, plan: Plan, hardware: Hardware, machine: Machine | None) -> Prediction:
    """The plan's step on `machine` (None: `hardware` as it is, copies overlapping)."""
    from slackswap.simulate import simulate
    from slackswap.simulate.saved_peak import instant_link

    if machine is None or not machine.synchronous:
        on = machine.on(hardware) if machine is not None else hardware
        sim = simulate(graph, plan, on, None)
        return Prediction(sim.step_s, sim.step_s, 0.0, len(plan.offloads) + len(plan.prefetches))
    sim = simulate(graph, plan, instant_link(hardware), None)
    sizes = graph.size_bytes_of
    copy_s = sum(machine.copy_s("d2h", sizes[t.tensor]) for t in plan.offloads)
    copy_s += sum(machine.copy_s("h2d", sizes[t.tensor]) for t in plan.prefetches)
    return Prediction(sim.step_s + copy_s, sim.step_s, copy_s, len(plan.offloads) + len(plan.prefetches))


@dataclass(frozen=True)
class StepComparison:
    """Measured steps after the first (warm-up) against a prediction."""

    predicted_s: float
    measured_median_s: float
    measured_min_s: float
    measured_max_s: float
    steps: int

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured: negative when the prediction is faster."""
        return (self.predicted_s - self.measured_median_s) / self.measured_median_s


def compare_steps(predicted_s: float, step_times_s: Sequence[float]) -> StepComparison:
    """The steps after the first (all of them when there is only one)."""
    kept = list(step_times_s[1:]) or list(step_times_s)
    return StepComparison(predicted_s, statistics.median(kept), min(kept), max(kept), len(kept))
