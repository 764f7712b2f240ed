"""`python -m pipelines.train model=<torch preset> planner=<p> train.steps=N train.device=cpu|cuda`.

Builds the preset's torch model on the device, captures the graph of one real step, plans it with the
chosen planner and budget, simulates the plan on the chosen hardware, checks that the plan's loss and
gradients equal a plain step's bit for bit, then runs N AdamW steps under the plan. Logs to MLflow:
measured step time and peak (max_memory_allocated on CUDA, the runtime's ledger on CPU) beside the
simulated ones, the gradient check, and the runtime's counts beside the plan's. Thin wiring: the work
is in slackswap.runtime.

Faults as `pipelines.run` (docs/pipeline.md, "Faults"): a bad value (`train.device=gpu`,
`budget.fraction=1.5`), an unknown preset or a misspelt key is one line and exit 2 before any MLflow
run; Ctrl-C / SIGTERM end the run KILLED (tag `status=killed`), one line, exit 130 / 143; any other
failure ends it FAILED with one line, exit 1. It ends by printing its run folder and MLflow run id.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import pipelines.schemas  # noqa: F401  (registers the schemas and the repo_root resolver)
from pipelines import faults, overrides, provenance, tracking
from pipelines.presentation import size_text
from pipelines.records import RunStatus
from slackswap.budget import Budget
from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig

DEVICES = ("cpu", "cuda")
EXECUTORS = ("eager", "compile")


def _validate(resolved: dict[str, Any]):
    from slackswap.profile.torch.spec import TorchSpec

    model_node = dict(resolved["model"])
    torch_node = model_node.pop("torch", None)
    if not torch_node:
        raise ConfigError("model.torch", None, "pipelines.train needs a torch preset (hf_*, tiny_torch, hf_gpt2_2l)")
    train = resolved["train"]
    if train["device"] not in DEVICES:
        raise ConfigError("train.device", train["device"], f"unknown device; known: {DEVICES}")
    if train["executor"] not in EXECUTORS:
        raise ConfigError("train.executor", train["executor"], f"unknown executor; known: {EXECUTORS}")
    if not isinstance(train["steps"], int) or train["steps"] < 1:
        raise ConfigError("train.steps", train["steps"], "must be an integer >= 1")
    if train["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", "no CUDA device is visible to this torch build")
    hardware = Hardware.from_dict(resolved["hardware"])
    return (ModelConfig.from_dict(model_node), TorchSpec.from_dict(torch_node), hardware,
            Budget.from_dict(resolved["budget"]), resolved["planner"])


def run_training(resolved: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Everything but MLflow: returns the figures (also written to run_dir/train.json)."""
    from slackswap.planners.registry import get_planner
    from slackswap.runtime import capture_graph, plan_counts
    from slackswap.runtime.compare import explain_ledger
    from slackswap.runtime.train import gradient_check, train_steps
    from slackswap.runtime.training_workload import build_training_workload
    from slackswap.simulate import simulate
    from slackswap.simulate.metrics import simulate_ideal
    from slackswap.simulate.saved_peak import instant_link, simulated_saved_peak_bytes

    model, spec, hardware, budget, planner = _validate(resolved)
    train = resolved["train"]
    print(f"[train] building {model.name} on {train['device']}", flush=True)
    w = build_training_workload(model, spec, train["device"], train["seed"])
    t0 = time.perf_counter()
    graph = capture_graph(w.model, (w.batch,), w.loss_fn, hardware, f"{model.name}@{hardware.name}")
    capture_s = time.perf_counter() - t0
    ideal = simulate_ideal(graph, hardware)
    budget_bytes = budget.resolve_bytes(ideal.peak_activation_bytes)
    print(f"[train] captured {len(graph.ops)} ops, {len(graph.saved_tensors)} saved tensors in {capture_s:.1f} s; "
          f"keep-all peak {size_text(ideal.peak_activation_bytes)}, budget {size_text(budget_bytes)}", flush=True)
    figures: dict[str, Any] = {"status": RunStatus.OK, "capture_s": capture_s, "budget_bytes": budget_bytes,
                               "keep_all_peak_bytes": ideal.peak_activation_bytes}
    try:
        plan = get_planner(planner["name"], **dict(planner.get("options") or {})).plan(graph, hardware, budget_bytes)
    except InfeasibleBudgetError as exc:
        figures.update(status=RunStatus.INFEASIBLE, infeasible_reason=str(exc))
        print(f"[train] infeasible: {exc}", flush=True)
        return figures
    sim = simulate(graph, plan, hardware, budget_bytes)
    # What the measured peak is compared with: the same plan on this device's link. On the CPU a copy
    # has arrived when it is issued (an instant link), so offloaded copies free earlier than on the
    # simulated hardware's link; on CUDA the hardware's own link.
    on_link = simulate(graph, plan, instant_link(hardware) if train["device"] == "cpu" else hardware, None)
    counts = plan_counts(plan)
    figures.update(sim_step_s=sim.step_s, sim_peak_activation_bytes=sim.peak_activation_bytes,
                   sim_peak_activation_bytes_device_link=on_link.peak_activation_bytes,
                   sim_saved_peak_bytes=simulated_saved_peak_bytes(graph, plan, hardware),
                   sim_saved_peak_bytes_link=simulated_saved_peak_bytes(graph, plan, hardware, instant=False),
                   **{f"plan_{k}": v for k, v in counts.items()})
    if train["executor"] == "compile":
        return _run_compiled(w, graph, plan, train, run_dir, figures)
    check = gradient_check(w, graph, plan, seed=train["seed"] + 1)
    why = explain_ledger(graph, plan, check.report.live_by_step)
    figures.update(grad_check_bit_exact=check.bit_exact, grad_check_max_abs_diff=check.max_abs_diff,
                   check_ledger_peak_bytes=check.report.ledger_peak_bytes,
                   ledger_plan_bytes_at_peak=why["plan_bytes_at_ledger_peak"],
                   ledger_late_bytes=why["late_bytes"], ledger_missing_copies=len(why["missing"]),
                   ledger_late_tensors=[name for name, _, _ in why["late"]])
    print(f"[train] plan: {counts}; gradient check bit-exact={check.bit_exact} "
          f"(max |diff| {check.max_abs_diff:g})", flush=True)

    def progress(r) -> None:
        peak = (f"peak {size_text(r.measured_peak_bytes)} (ledger {size_text(r.ledger_peak_bytes)})"
                if r.report.verified else "hook-only step (no ledger)")
        print(f"[train] step {r.step + 1}/{train['steps']} loss {r.loss:.4f} time {r.step_s * 1e3:.1f} ms {peak}",
              flush=True)

    records = train_steps(w, graph, plan, train["steps"], train["lr"], train["seed"], progress)
    last = records[-1].report
    timed = [r.step_s for r in records[1:]] or [records[0].step_s]
    figures.update(
        measured_step_s=statistics.median(timed),
        measured_peak_bytes=max(r.measured_peak_bytes for r in records),
        ledger_peak_bytes=max(r.ledger_peak_bytes for r in records),
        runtime_recompute_steps=last.recompute_steps, runtime_offloads=last.offloads,
        runtime_prefetches=last.prefetches, late_prefetch_waits=sum(r.report.late_prefetch_waits for r in records),
        losses=[r.loss for r in records], step_times_s=[r.step_s for r in records],
        counts_equal_plan=(last.recompute_steps, last.offloads, last.prefetches)
        == (counts["recompute_steps"], counts["offloads"], counts["prefetches"]),
    )
    if train["device"] == "cpu":
        # The CPU ledger counts the graph's tensors, as the simulator does; on CUDA the measured peak
        # is max_memory_allocated (weights and optimizer state too) and is not compared byte for byte.
        figures.update(measured_equals_sim=figures["measured_peak_bytes"] == on_link.peak_activation_bytes,
                       measured_within_budget=budget_bytes is None or figures["measured_peak_bytes"] <= budget_bytes)
    figures["versions"] = provenance.versions()
    (run_dir / "train.json").write_text(json.dumps(figures, indent=2))
    print(f"[train] measured step {figures['measured_step_s'] * 1e3:.1f} ms (simulated {sim.step_s * 1e3:.3f} ms "
          f"on {hardware.name}); measured peak {size_text(figures['measured_peak_bytes'])}, simulated peak "
          f"{size_text(on_link.peak_activation_bytes)} on this device's link "
          f"({size_text(sim.peak_activation_bytes)} on {hardware.name}), budget {size_text(budget_bytes)}; "
          f"saved-tensor ledger {size_text(figures['ledger_peak_bytes'])} vs "
          f"simulated saved peak {size_text(figures['sim_saved_peak_bytes'])}", flush=True)
    if train["device"] == "cpu":
        print(f"[train] measured peak == simulated peak: {figures['measured_equals_sim']}; within budget: "
              f"{figures['measured_within_budget']}", flush=True)
    return figures


def _run_compiled(w, graph, plan, train: dict, run_dir: Path, figures: dict[str, Any]) -> dict[str, Any]:
    """train.executor=compile: the plan as selective checkpointing, each layer torch.compile'd. No
    ledger (nothing of slackswap runs inside the step); the export's differences from the plan are
    listed instead, and the gradient check reports the largest difference (compiled kernels and
    inductor's random numbers are not eager's, so bit equality is not expected)."""
    from slackswap.runtime.train import compiled_gradient_check, train_steps

    check = compiled_gradient_check(w, graph, plan, seed=train["seed"] + 1)
    figures.update(grad_check_bit_exact=check.bit_exact, grad_check_max_abs_diff=check.max_abs_diff,
                   export_differences=len(check.differences),
                   export_difference_tensors=[d.tensor for d in check.differences])
    print(f"[train] executor=compile: gradient check max |diff| {check.max_abs_diff:g}; "
          f"{len(check.differences)} decisions PyTorch executes otherwise", flush=True)

    def progress(r) -> None:
        print(f"[train] step {r.step + 1}/{train['steps']} loss {r.loss:.4f} time {r.step_s * 1e3:.1f} ms", flush=True)

    records = train_steps(w, graph, plan, train["steps"], train["lr"], train["seed"], progress, executor="compile",
                          export=check.export, backend=check.backend)  # compiled once, in the check
    timed = [r.step_s for r in records[1:]] or [records[0].step_s]
    figures.update(measured_step_s=statistics.median(timed), losses=[r.loss for r in records],
                   step_times_s=[r.step_s for r in records])
    if w.batch.device.type == "cuda":
        figures["measured_peak_bytes"] = max(r.measured_peak_bytes for r in records)
    figures["versions"] = provenance.versions()
    (run_dir / "train.json").write_text(json.dumps(figures, indent=2))
    return figures


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
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
    overrides.check_traced_attention(resolved, list(HydraConfig.get().overrides.task))
    _validate(resolved)  # bad values fail before an MLflow run exists
    track = resolved["tracking"]
    client = run_id = None
    if track["enabled"]:
        client = tracking.open_client(track["uri"])
        experiment_id = tracking.ensure_experiment(client, track["experiment"], track["artifact_location"])
        name = f"train:{resolved['model']['name']}:{resolved['planner']['name']}:{resolved['train']['device']}"
        run_id = tracking.start_run(
            client, experiment_id, name, {"kind": "train", "status": "running"}, None, "pipelines/train.py"
        )
        faults.track_in_flight(client, run_id)  # an interrupt anywhere ends it KILLED
        tracking.log_params(client, run_id, tracking.flatten_params(resolved))
    try:
        figures = run_training(resolved, run_dir)
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
        tracking.log_tags(client, run_id, {"status": str(status)})
        if (run_dir / "train.json").exists():
            tracking.store_artifacts(client, run_id, [run_dir / "train.json"], track["artifact_location"])
        tracking.end_run(client, run_id, status)
        faults.done_in_flight(run_id)
    print(f"[train] run dir {run_dir}", flush=True)
    if run_id is not None:
        print(f"[train] mlflow run {run_id} ({track['uri']})", flush=True)
    return figures


def _interrupted(exc: faults.Interrupted) -> str:
    marked = faults.kill_in_flight_except(None)
    return f"interrupted by {exc}; {marked} MLflow run(s) marked KILLED"


def cli() -> int:
    return faults.run_cli(main, _interrupted, lambda: 0)


if __name__ == "__main__":
    sys.exit(cli())
