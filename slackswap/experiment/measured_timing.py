"""`profile.timing=measured` in a training run: the captured graph re-timed by its ops measured on the
device, the machine's links, and the plan's predicted step beside the measured one.

    timing = MeasuredTiming.from_dict(config["profile"])      # checks, ConfigError naming the field
    graph, figures, costs = timing.retime(graph, workload, hardware, export_block_shape(model))  # before planning
    machine, links = timing.machine(device)                   # measured links (or the given file)
    figures |= timing.compare(graph, plan, hardware, machine, step_times_s, costs)

The profile comes from plain steps of the model (`slackswap.runtime.op_times`), measured once
per graph, device and versions and cached, as the machine's links are; a cached table or
description measured under load is measured again (`slackswap.profile.measured.load_refusal`), and
the run says in one line each which it reused and which it measured
(`slackswap.profile.measured.cache_line`). No plan's own timed steps feed its prediction. The
executors' own host costs (`slackswap.experiment.measured_prediction.HostCosts`) are measured once on
the CPU by fixed microbenchmarks when the table is, and stored with it; the prediction is the
benchmark's (`predict_measured`); on the CPU the table also times each op's replay and each saved
tensor's copies by the runtime (`profiling_plans`), at which the prediction prices the plan's recompute
steps and copies. Imports torch
only inside the functions that measure.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slackswap import validation as check
from slackswap.errors import ConfigError
from slackswap.experiment.measured_prediction import (
    HostCosts,
    measure_host_costs,
    predict_measured,
    profiling_plans,
)
from slackswap.experiment.prediction import compare_steps, predict_step
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.profile.machine import Machine
from slackswap.profile.measured import (
    TIMINGS,
    cache_line,
    load_text,
    retime,
    save_table,
    sum_gap,
    sum_refusal,
)

if TYPE_CHECKING:
    from slackswap.runtime.training_workload import Workload

#: Largest copy measured when a run measures the CPU's links itself (a few seconds at most); the
#: standalone `python -m pipelines.measure_links` goes to 1 GiB where memory allows.
RUN_LINK_MAX_BYTES = 64 * 1024**2
#: Relative change of the plain step, before the plan's steps to after them, above which the machine's
#: own variation is as large as what a prediction's error can say.
PLAIN_DRIFT_LIMIT = 0.10


@dataclass(frozen=True)
class PlainDrift:
    """The plain step timed right before the plan's steps and again right after them, each the median of
    the steps after the first (as the plan's are compared): how far the machine itself moved."""

    before_s: float
    after_s: float
    limit: float = PLAIN_DRIFT_LIMIT

    @classmethod
    def of(cls, before_times_s: Sequence[float], after_times_s: Sequence[float],
           limit: float = PLAIN_DRIFT_LIMIT) -> PlainDrift:
        from slackswap.experiment.prediction import compare_steps

        return cls(compare_steps(0.0, before_times_s).measured_median_s,
                   compare_steps(0.0, after_times_s).measured_median_s, limit)

    @property
    def mean_s(self) -> float:
        """The plain step's speed while the plan's steps ran, bracketed by the two medians."""
        return (self.before_s + self.after_s) / 2

    @property
    def drift(self) -> float:
        """(after - before) / before: positive when the plain step got slower."""
        return (self.after_s - self.before_s) / self.before_s

    @property
    def exceeds(self) -> bool:
        return abs(self.drift) > self.limit

    def figures(self) -> dict[str, Any]:
        return {"plain_step_before_s": self.before_s, "plain_step_after_s": self.after_s,
                "plain_step_drift": self.drift, "plain_step_drift_exceeds_limit": self.exceeds}

    def line(self) -> str:
        text = (f"plain step {self.before_s * 1e3:.2f} ms before the plan's steps, {self.after_s * 1e3:.2f} ms "
                f"after: drift {self.drift * 100:+.1f} %")
        if self.exceeds:
            text += (f"; over {self.limit * 100:.0f} %: the comparison above is inside the machine's own "
                     "variation")
        return text


@dataclass(frozen=True)
class PairedPrediction:
    """The plan's predicted step at the speed the machine runs at while its steps run.

    On a shared CPU the same plain step moves by tens of percent from one second to the next and from
    one process to the next (hf_gpt2_2l's, median of 8 steps, 5.8 to 9.8 ms in blocks a second apart;
    docs/profile.md, "Measured op times and links"), so a table measured earlier, or by another run, prices every op at
    the speed the machine had then. The plain steps timed right before and right after the plan's steps
    (`PlainDrift`, timed as the profile's are) bracket how fast it ran meanwhile: the prediction scaled by
    their mean over the plain step simulated on the table is the plan's step at that speed, its overhead
    over the plain step still the table's and the model's, as the benchmark's paired overheads read it.
    The plan's own steps never feed it; keep-all's paired error is its steps' noise alone."""

    predicted_s: float
    #: The plain step simulated on the table: keep-all, no executor, no copies.
    predicted_plain_s: float
    #: The mean of the plain steps' medians before and after the plan's steps (`PlainDrift`).
    plain_now_s: float
    measured_median_s: float

    @property
    def speed(self) -> float:
        """This run's plain step over the table's simulated one: above 1 when the machine runs slower now."""
        return self.plain_now_s / self.predicted_plain_s

    @property
    def paired_predicted_s(self) -> float:
        return self.predicted_s * self.speed

    @property
    def relative_error(self) -> float:
        return (self.paired_predicted_s - self.measured_median_s) / self.measured_median_s

    def figures(self) -> dict[str, Any]:
        return {"predicted_plain_step_s": self.predicted_plain_s, "plain_step_speed_now": self.speed,
                "predicted_step_paired_s": self.paired_predicted_s,
                "step_relative_error_paired": self.relative_error}

    def line(self) -> str:
        return (f"at this run's speed (plain step {self.plain_now_s * 1e3:.2f} ms around the plan's steps, "
                f"simulated on the table {self.predicted_plain_s * 1e3:.2f} ms: x{self.speed:.3f}): predicted "
                f"{self.paired_predicted_s * 1e3:.2f} ms vs measured {self.measured_median_s * 1e3:.2f} ms: "
                f"error {self.relative_error * 100:+.1f} %")


@dataclass(frozen=True)
class MeasuredTiming:
    timing: str = "roofline"
    cache_dir: str | None = None
    warmup: int = 2
    repeats: int = 5
    machine_path: str | None = None

    @property
    def measured(self) -> bool:
        return self.timing == "measured"

    @classmethod
    def from_dict(cls, profile: Mapping[str, Any] | None) -> MeasuredTiming:
        profile = dict(profile or {})
        timing = profile.get("timing", "roofline")
        if timing not in TIMINGS:
            raise ConfigError("profile.timing", timing, f"unknown timing; known: {TIMINGS}")
        warmup = check.integer("profile.warmup", profile.get("warmup", cls.warmup), 0)
        repeats = check.integer("profile.repeats", profile.get("repeats", cls.repeats), 1)
        machine = profile.get("machine")
        if machine is not None and not Path(machine).is_file():
            raise ConfigError("profile.machine", machine, "no such machine description file")
        return cls(timing=timing, cache_dir=profile.get("cache_dir") or None, warmup=warmup, repeats=repeats,
                   machine_path=machine)

    def retime(self, graph: Graph, w: Workload, hardware: Hardware, shape: tuple[int, int] | None = None
               ) -> tuple[Graph, dict[str, Any], HostCosts]:
        """The graph with its ops' measured times (roofline for any op not measured), the figures
        saying how many ops each source timed, and the executors' host costs stored with the table
        (measured now, and stored, where a CPU table lacks them; the export's at `shape`,
        `export_block_shape` of the run's model); on the CPU the table holds each op's replay time and each
        offloaded tensor's copy times too (a cached one without them is measured again). `hardware`: the
        run's, which the replays' full-recompute plan is made for."""
        from slackswap.runtime.op_times import cached_op_times

        table, cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, self.cache_dir, self.warmup,
                                        self.repeats, **profiling_plans(hardware))
        costs = HostCosts.of(table)
        if table.key.device.startswith("cpu") and not costs.measured:
            costs = measure_host_costs(table.key.device, shape)
            table = costs.attach(table)
            costs = HostCosts.of(table)  # with the table's replay times
            if self.cache_dir is not None:
                save_table(table, self.cache_dir)
        retimed, sources = retime(graph, table)
        figures = {"timing": "measured", "ops_timed_measured": sources.measured,
                   "ops_timed_roofline": sources.roofline, "op_times_cached": cached,
                   "op_times_device": table.key.device, "op_times_sum_s": table.measured_sum_s,
                   "profile_plain_step_s": table.step_median_s,
                   "profile_plain_step_min_s": table.step_min_s, "profile_plain_step_max_s": table.step_max_s,
                   "timer_overhead_per_call_s": table.timer_overhead_per_call_s,
                   # The table's op times carry the load they were measured at (a cached table was
                   # measured by an earlier run): the timer's cost taken off each op is not load-free.
                   "op_times_load_average": table.notes.get("load_average_1min", math.nan),
                   # A cached table measured under load is measured again (`reuse_refusal`): why, or "".
                   "op_times_remeasured_because": table.notes.get("remeasured_because", "") if not cached else "",
                   "op_times_cache_line": cache_line(f"op-time table {table.key.digest()}", cached, table.notes,
                                                     self.cache_dir),
                   "timing_sources_line": sources.line(), "host_costs_line": costs.line(),
                   # The op times against the table's own plain step: a table whose ops do not add up to
                   # it predicts nothing (`sum_refusal`), said beside the prediction, never silently.
                   "op_times_sum_gap": sum_gap(table), "op_times_sum_refusal": sum_refusal(table) or "",
                   # NaN where none were measured (a GPU table), as the load above: never a count.
                   "replay_times_ops": math.nan if table.replay_times is None else len(table.replay_times),
                   "replay_source": str(table.notes.get("replay_source", "")),
                   "copy_times_tensors": math.nan if table.copy_times is None else len(table.copy_times),
                   "copy_source": str(table.notes.get("copy_source", ""))}
        return retimed, figures, costs

    def machine(self, device: str) -> tuple[Machine, dict[str, Any]]:
        """The machine description of `profile.machine`, else the links of `device` measured now (on
        the CPU, up to `RUN_LINK_MAX_BYTES`) or cached beside the op times under the op-time table's
        rule (`slackswap.profile.torch.links.cached_machine_description`); and the figures saying which
        (`machine_cache_line` is the run's line for it)."""
        import yaml

        if self.machine_path is not None:
            description = yaml.safe_load(Path(self.machine_path).read_text())
            notes = description.get("notes") if isinstance(description, dict) else None
            load = load_text(notes if isinstance(notes, Mapping) else {})
            return Machine.from_dict(description), {
                "machine_cached": False, "machine_remeasured_because": "",
                "machine_cache_line": f"machine description {self.machine_path} given by profile.machine "
                                      f"(measured at {load}), used as given"}
        from slackswap.profile.torch.links import cached_machine_description, machine_cache_path

        description, cached = cached_machine_description(device, self.cache_dir, RUN_LINK_MAX_BYTES, repeats=3)
        notes = description.get("notes") or {}
        name = machine_cache_path(self.cache_dir, device).name if self.cache_dir is not None else device
        return Machine.from_dict(description), {
            "machine_cached": cached, "machine_load_average": notes.get("load_average_1min", math.nan),
            "machine_remeasured_because": notes.get("remeasured_because", "") if not cached else "",
            "machine_cache_line": cache_line(f"machine description {name}", cached, notes, self.cache_dir)}

    @staticmethod
    def plain_steps(w: Workload, steps: int) -> list[float]:
        """Seconds of `steps` plain steps of the workload now, timed as the profile's are."""
        from slackswap.runtime.op_times import plain_step_times

        return plain_step_times(w.model, (w.batch,), w.loss_fn, steps)

    @staticmethod
    def paired(graph: Graph, hardware: Hardware, machine: Machine, figures: Mapping[str, Any],
               drift: PlainDrift) -> dict[str, Any]:
        """`PairedPrediction`'s figures for the prediction in `figures` (`compare`'s), at the speed of the
        plain steps timed around the plan's (`drift`)."""
        from slackswap.schedule.build import keep_all_plan

        plain = predict_step(graph, keep_all_plan(graph), hardware, machine).step_s
        return PairedPrediction(figures["predicted_step_s"], plain, drift.mean_s,
                                figures["measured_step_median_s"]).figures()

    @staticmethod
    def compare(graph: Graph, plan: Plan, hardware: Hardware, machine: Machine, step_times_s: Sequence[float],
                costs: HostCosts, export: bool = False, model: object = None) -> dict[str, Any]:
        """The predicted step (`predict_measured`, as `benchmarks/measured_profile.py` predicts it) beside
        the measured steps (after the first) and the relative error. `export`: `plan` was made for the
        export and ran as eager selective checkpointing; `model` is the plan's."""
        predicted = predict_measured(graph, plan, hardware, machine, costs, export, model)
        prediction = predicted.prediction
        c = compare_steps(prediction.step_s, step_times_s)
        return predicted.figures | {
            "predicted_step_s": c.predicted_s, "predicted_sim_step_s": prediction.simulated_s,
            "predicted_sync_copy_s": prediction.sync_copy_s, "measured_step_median_s": c.measured_median_s,
            "measured_step_min_s": c.measured_min_s, "measured_step_max_s": c.measured_max_s,
            "measured_steps_compared": c.steps, "step_relative_error": c.relative_error,
            "machine": machine.name, "machine_synchronous_copies": machine.synchronous,
            "load_avg_1m": os.getloadavg()[0]}
