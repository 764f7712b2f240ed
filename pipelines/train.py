"""`python -m pipelines.train model=<torch preset> planner=<p> train.steps=N train.device=cpu|cuda`.

Builds the preset's torch model on the device, captures the graph of one real step, plans it with the
chosen planner and budget, simulates the plan on the chosen hardware, checks that the plan's loss and
gradients equal a plain step's bit for bit, then runs N AdamW steps under the plan. Logs to MLflow:
measured step time and peak (max_memory_allocated on CUDA, the runtime's ledger on CPU) beside the
simulated ones, the gradient check, and the runtime's counts beside the plan's. Thin wiring: the run
is `slackswap.experiment.training_run` (its spec, its steps, its figures); this module validates the
config, prints the console lines, writes train.json with the versions, and logs to MLflow.

Faults as `pipelines.run` (docs/pipeline.md, "Faults"): a bad value (`train.device=gpu`,
`budget.fraction=1.5`), an unknown preset or a misspelt key is one line and exit 2 before any MLflow
run; Ctrl-C / SIGTERM end the run KILLED (tag `status=killed`), one line, exit 130 / 143; any other
failure ends it FAILED with one line, exit 1. It ends by printing its run folder and MLflow run id.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import pipelines.schemas  # noqa: F401  (registers the schemas and the repo_root resolver)
from pipelines import faults, hydra_versions, overrides, provenance, tracking
from pipelines.presentation import size_text
from pipelines.records import RunStatus
from slackswap.errors import ConfigError
from slackswap.experiment.training_run import TrainingProgress, TrainingRunOutcome, TrainingRunSpec, run_training


class _Console(TrainingProgress):
    """The run's console lines, as it goes."""

    def __init__(self, spec: TrainingRunSpec):
        self.spec = spec
        #: The executor that runs the steps (auto: eager until the hook-only program refuses the plan).
        self.executor = "eager" if spec.executor == "auto" else spec.executor

    def building(self, spec) -> None:
        print(f"[train] building {spec.model.name} on {spec.device}", flush=True)

    def host_allocator(self, detail) -> None:
        print(f"[train] host allocator: {detail}", flush=True)

    def captured(self, graph, capture_s, keep_all_peak_bytes, budget_bytes) -> None:
        print(f"[train] captured {len(graph.ops)} ops, {len(graph.saved_tensors)} saved tensors in {capture_s:.1f} s; "
              f"keep-all peak {size_text(keep_all_peak_bytes)}, budget {size_text(budget_bytes)}", flush=True)

    def infeasible(self, reason) -> None:
        print(f"[train] infeasible: {reason}", flush=True)

    def checked(self, counts, check) -> None:
        print(f"[train] plan: {counts}; gradient check bit-exact={check.bit_exact} "
              f"(max |diff| {check.max_abs_diff:g})", flush=True)

    def compiled_checked(self, check) -> None:
        print(f"[train] executor=compile: gradient check max |diff| {check.max_abs_diff:g}; "
              f"{len(check.differences)} decisions PyTorch executes otherwise", flush=True)

    def refused(self, reason) -> None:
        print(f"[train] executor=auto: the runtime's hook-only program refuses the plan ({reason}); its steps "
              "would run verified, under dispatch modes: running the plan made for the export as eager selective "
              "checkpointing instead", flush=True)
        self.executor = "export"

    def export_checked(self, check) -> None:
        print(f"[train] executor=export: gradient check bit-exact={check.bit_exact} (max |diff| "
              f"{check.max_abs_diff:g}); {check.differences} decisions PyTorch executes otherwise", flush=True)

    def step(self, record) -> None:
        done = (f"[train] step {record.step + 1}/{self.spec.steps} loss {record.loss:.4f} "
                f"time {record.step_s * 1e3:.1f} ms")
        if self.executor in ("compile", "export"):
            print(done, flush=True)
            return
        peak = (f"peak {size_text(record.measured_peak_bytes)} (ledger {size_text(record.ledger_peak_bytes)})"
                if record.report.verified else "hook-only step (no ledger)")
        print(f"{done} {peak}", flush=True)

    def timed(self, figures) -> None:
        # One line per cached measurement: reused (at its load), measured again (why) or measured now.
        for key in ("op_times_cache_line", "machine_cache_line"):
            if figures.get(key):
                print(f"[train] {figures[key]}", flush=True)
        print(f"[train] {figures['timing_sources_line']} on {figures['op_times_device']}; sum of op "
              f"times {figures['op_times_sum_s'] * 1e3:.1f} ms, plain step {figures['profile_plain_step_s'] * 1e3:.1f}"
              f" ms", flush=True)
        if figures.get("op_times_sum_refusal"):
            print(f"[train] {figures['op_times_sum_refusal']}", flush=True)
        if figures.get("host_costs_line"):
            print(f"[train] executors' host costs on this machine: {figures['host_costs_line']}", flush=True)
        if figures.get("replay_source"):  # what the op-time table's replay times are, or why there are none
            print(f"[train] {figures['replay_source']}", flush=True)
        if figures.get("copy_source"):  # what the op-time table's copy times are, or why there are none
            print(f"[train] {figures['copy_source']}", flush=True)


def _summary(spec: TrainingRunSpec, f) -> None:
    """The closing lines of an eager run: measured against simulated, step time and peak."""
    simulated = (f"simulated {f['sim_step_s'] * 1e3:.3f} ms" if f["sim_step_s"] is not None
                 else f"simulated: infeasible, {f.get('sim_infeasible_reason')}")
    print(f"[train] measured step {f['measured_step_s'] * 1e3:.1f} ms ({simulated} "
          f"on {spec.hardware.name}); measured peak {size_text(f['measured_peak_bytes'])}, simulated peak "
          f"{size_text(f['sim_peak_activation_bytes_device_link'])} on this device's link "
          f"({size_text(f['sim_peak_activation_bytes'])} on {spec.hardware.name}), budget "
          f"{size_text(f['budget_bytes'])}; saved-tensor ledger {size_text(f['ledger_peak_bytes'])} vs "
          f"simulated saved peak {size_text(f['sim_saved_peak_bytes'])}", flush=True)
    if "step_relative_error" in f:
        from pipelines.measured_console import comparison_line, drift_line

        print(comparison_line(f), flush=True)
        drift = drift_line(f)  # the plain step re-measured after the plan's steps
        if drift:
            print(drift, flush=True)
    if spec.device == "cpu":
        print(f"[train] measured peak == simulated peak: {f['measured_equals_sim']}; within budget: "
              f"{f['measured_within_budget']}", flush=True)


def _export_summary(f) -> None:
    """The closing lines of a run through the eager export: the measured step and, on measured op times,
    its prediction as eager checkpointing runs the plan (the layers' replays counted)."""
    print(f"[train] measured step {f['measured_step_s'] * 1e3:.1f} ms through the eager export; gradient check "
          f"bit-exact={f['grad_check_bit_exact']}", flush=True)
    if "step_relative_error" in f:
        from pipelines.measured_console import comparison_line, drift_line

        print(comparison_line(f) + f" (eager checkpointing runs {f['executed_recomputes']} recomputes, the plan "
              f"{f['plan_recomputes']})", flush=True)
        drift = drift_line(f)  # the plain step re-measured after the plan's steps
        if drift:
            print(drift, flush=True)


def run_training_job(spec: TrainingRunSpec, run_dir: Path) -> dict[str, Any]:
    """The run with its console lines; an OK run's figures, with the versions, go to run_dir/train.json.
    Returns the figures."""
    outcome: TrainingRunOutcome = run_training(spec, _Console(spec))
    figures = dict(outcome.figures)
    figures["status"] = RunStatus(outcome.verdict)
    if outcome.verdict == RunStatus.OK:
        figures["versions"] = provenance.versions()
        (run_dir / "train.json").write_text(json.dumps(figures, indent=2))
        if figures.get("executor") == "eager":
            _summary(spec, figures)
        elif figures.get("executor") == "export":
            _export_summary(figures)
    return figures


@hydra.main(**hydra_versions.MAIN_VERSION, config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> dict[str, Any]:
    try:
        return train_job(cfg)
    except ConfigError as exc:
        if faults.full_error():
            raise
        raise faults.Abort(f"error: {exc}", code=faults.EXIT_CONFIG_ERROR) from None


def train_job(cfg: DictConfig) -> dict[str, Any]:
    from pipelines.job import resolve_config

    resolved = resolve_config(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    faults.note_output_dir(run_dir)
    overrides.check_traced_attention(resolved, list(HydraConfig.get().overrides.task))
    overrides.check_hook(resolved)
    spec = TrainingRunSpec.from_dict(resolved)  # bad values fail before an MLflow run exists
    track = resolved["tracking"]
    client = run_id = None
    if track["enabled"]:
        client = tracking.open_client(track["uri"])
        experiment_id = tracking.ensure_experiment(client, track["experiment"], track["artifact_location"])
        name = f"train:{resolved['model']['name']}:{resolved['planner']['name']}:{resolved['train']['device']}"
        run_id = tracking.create_run(
            client, experiment_id, name, {"kind": "train", "status": "running"}, None, "pipelines/train.py"
        ).run_id
        faults.track_in_flight(client, run_id)  # an interrupt anywhere ends it KILLED
        tracking.log_params(client, run_id, tracking.flatten_params(resolved))
    try:
        figures = run_training_job(spec, run_dir)
    except Exception as exc:
        if faults.full_error():
            raise
        from pipelines.job import failure_reason

        reason = failure_reason(exc)
        trace_path = run_dir / "traceback.txt"
        with contextlib.suppress(OSError):
            trace_path.write_text(traceback.format_exc())
        if run_id is not None:
            faults.kill_run(client, run_id, RunStatus.FAILED, reason)
        where = f"; MLflow run {run_id} FAILED" if run_id else ""
        raise faults.Abort(f"error: training failed: {reason}; traceback in {trace_path}{where}") from None
    status = figures["status"]
    if client is not None:
        scalars = {k: (int(v) if isinstance(v, bool) else v) for k, v in figures.items()
                   if isinstance(v, (int, float, bool))}
        tracking.log_metrics(client, run_id, scalars)
        for i, (loss, step_s) in enumerate(zip(figures.get("losses", []), figures.get("step_times_s", []),
                                               strict=True)):
            client.log_metric(run_id, "step_loss", loss, step=i)
            client.log_metric(run_id, "step_time_s", step_s, step=i)
        timing = {k: str(figures[k]) for k in ("timing", "timing_sources_line", "op_times_device", "machine",
                                                       "host_costs_line", "op_times_cache_line", "machine_cache_line",
                                                       "op_times_sum_refusal", "replay_source",
                                                       "copy_source", "host_allocator")
                  if k in figures}  # which source timed the ops, on the run itself
        tracking.log_tags(client, run_id, {"status": str(status), **timing})
        if (run_dir / "train.json").exists():
            tracking.store_artifacts(client, run_id, [run_dir / "train.json"], track["artifact_location"])
        tracking.end_run(client, run_id, status)
        faults.done_in_flight(run_id)
    print(f"[train] run dir {run_dir}", flush=True)
    if run_id is not None:
        print(f"[train] mlflow run {run_id} ({track['uri']})", flush=True)
    return figures


def _interrupted(exc: faults.Interrupted) -> str:
    faults.kill_in_flight_except(None)
    return f"interrupted by {exc}{faults.interrupted_tail()}"


def cli() -> int:
    return faults.run_cli(main, _interrupted, lambda: 0)


if __name__ == "__main__":
    sys.exit(cli())
