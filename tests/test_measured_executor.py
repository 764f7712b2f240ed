"""The measured comparison's executor choice: a plan the runtime's hook-only program refuses is
measured through the eager export (`benchmarks/measured_profile.py`, `slackswap.experiment.measured_executor`)."""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

require_torch_extra()

from benchmarks.measured_cases import HARDWARE, cases  # noqa: E402
from benchmarks.measured_profile import measure_plan  # noqa: E402
from slackswap.experiment.export_plan import plan_for_export  # noqa: E402
from slackswap.experiment.measured_executor import export_gradient_check, predict_export  # noqa: E402
from slackswap.hardware import load_preset  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.simulate import simulate  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    """tiny_torch as the benchmark builds it, captured on the roofline (the executor choice needs no op times)."""
    from slackswap.runtime import capture_graph
    from slackswap.runtime.training_workload import build_training_workload

    name, model, spec = next(c for c in cases() if c[0] == "tiny_torch")
    hardware = load_preset(HARDWARE)
    w = build_training_workload(model, spec, "cpu", 0)
    return w, capture_graph(w.model, (w.batch,), w.loss_fn, hardware, name), hardware


@pytest.mark.slow
def test_a_plan_the_hook_only_program_refuses_is_measured_through_the_export(tiny):
    w, graph, hardware = tiny
    row = measure_plan(w, graph, hardware, None, "torch_sac", None, 2, "process", "auto")
    assert row["executor"] == "export"
    # The runtime's reason stays on the row beside the export's timing.
    assert "a tensor autograd does not save" in row["hook_only_refusal"]
    assert row["grad_bit_exact"] is True and "refused" not in row
    assert row["steps"] == 2 and row["steps_verified"] == 0 and row["measured_median_s"] > 0
    # Predicted as eager checkpointing runs it: the layer's replay runs more than the plan's recomputes.
    assert row["executed_recomputes"] > row["plan_recomputes"] > 0
    assert row["export_differences"] == 0
    # Its steps ran in rounds with keep_all's on a copy of the model (same weights, batches, RNG stream):
    # both sides exact, they stay equal step for step, and keep_all ran on the runtime's hooks alone.
    assert len(row["round_step_s"]) == len(row["round_keep_all_step_s"]) == 2
    assert row["paired_losses_equal"] is True and row["paired_keep_all_steps_verified"] == 0


@pytest.mark.slow
def test_the_runtime_executor_still_runs_a_refused_plan_verified(tiny):
    w, graph, hardware = tiny
    row = measure_plan(w, graph, hardware, None, "torch_sac", None, 1, "process", "runtime")
    assert row["executor"] == "runtime" and row["hook_only_refusal"]
    assert row["steps_verified"] == row["steps"] == 1


@pytest.mark.slow
def test_the_exported_step_equals_the_plain_step_and_its_prediction_counts_the_replay(tiny):
    w, graph, hardware = tiny
    plan = plan_for_export(get_planner("torch_sac"), graph, w.model, hardware, None)
    check = export_gradient_check(w, graph, plan)
    assert check.bit_exact and check.max_abs_diff == 0.0 and check.differences == 0
    predicted = predict_export(graph, plan, hardware, None)
    own = simulate(graph, plan, hardware, None).step_s
    # The replayed transients cost time the plan's own schedule does not have.
    assert predicted.executed_recomputes > predicted.plan_recomputes
    assert predicted.prediction.step_s > own


@pytest.mark.slow
def test_a_training_run_with_executor_auto_runs_a_refused_plan_through_the_export(tmp_path, monkeypatch):
    import math
    from pathlib import Path

    import torch
    import yaml

    import slackswap.experiment.measured_timing as measured_timing
    from slackswap.experiment.measured_prediction import HostCosts
    from slackswap.experiment.training_run import TrainingRunSpec, run_training
    from slackswap.profile.measured import ExportHostCost, RuntimeHostCost

    # The microbenchmarks' figures (tests/test_export_mechanism.py measures them), without their time here.
    export = ExportHostCost(sac_per_call_s=1.5e-5, checkpoint_per_region_s=2e-4, checkpoint_per_saved_s=1.5e-5,
                            source="slackswap.runtime.export.dispatch_cost (stub)")
    monkeypatch.setattr(measured_timing, "measure_host_costs",
                        lambda device, shape: HostCosts(RuntimeHostCost(source="stub"), export))

    conf = Path(__file__).resolve().parents[1] / "conf"

    def preset(group, name):
        data = yaml.safe_load((conf / group / f"{name}.yaml").read_text())
        data.pop("defaults", None)
        return data

    config = {"model": {**preset("model", "tiny"), **preset("model", "tiny_torch")},
              "hardware": preset("hardware", "h200_sxm_pcie5"), "budget": preset("budget", "full"),
              "planner": preset("planner", "torch_sac"),
              "train": {**yaml.safe_load((conf / "train.yaml").read_text())["train"], "steps": 2, "executor": "auto"},
              "profile": {"timing": "measured", "cache_dir": str(tmp_path), "warmup": 0, "repeats": 1}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a shared core pair make each step seconds long
    try:
        outcome = run_training(TrainingRunSpec.from_dict(config))
    finally:
        torch.set_num_threads(threads)
    f = outcome.figures
    assert outcome.verdict == "ok", outcome.reason
    assert f["executor"] == "export" and "a tensor autograd does not save" in f["hook_only_refusal"]
    assert f["grad_check_bit_exact"] is True and f["export_differences"] == 0
    assert f["executed_recomputes"] > f["plan_recomputes"] > 0
    assert f["measured_steps_compared"] == 1 and math.isfinite(f["step_relative_error"])
    assert math.isfinite(f["plain_step_drift"])  # the machine's drift over the export's steps, beside it
    # The SAC layers' dispatch, at the microbenchmark's cost per call (never this plan's step), is in the
    # prediction and says where it came from.
    assert f["sac_dispatch_calls"] > 0 and f["sac_dispatch_per_call_s"] > 0
    assert f["predicted_dispatch_s"] == f["sac_dispatch_calls"] * f["sac_dispatch_per_call_s"]
    assert "slackswap.runtime.export.dispatch_cost" in f["sac_dispatch_source"]
    # Every layer is a checkpoint region, with its own host work per region and per saved tensor.
    assert f["checkpoint_regions"] == 2 and f["checkpoint_saved"] > 0
    assert f["predicted_checkpoint_s"] == pytest.approx(2 * 2e-4 + f["checkpoint_saved"] * 1.5e-5)
    # The views each layer's replay runs again, at their op times.
    assert f["replayed_views"] > 0 and f["predicted_replayed_views_s"] > 0
    assert f["predicted_step_s"] == pytest.approx(f["predicted_sim_step_s"] + f["predicted_sync_copy_s"]
                                                  + f["predicted_dispatch_s"] + f["predicted_checkpoint_s"]
                                                  + f["predicted_replayed_views_s"])
