"""`python -m pipelines.train` end to end on the CPU: real steps under the plan, MLflow run with the
measured and simulated figures and the gradient check; everything under tmp_path."""

from __future__ import annotations

import json

import pytest

from tests.extras import require_torch_extra

require_torch_extra("torch")
require_torch_extra("transformers")

from tests.test_pipeline import _run_cli  # noqa: E402

SMALL = ["model.hidden_size=32", "model.ffn_hidden_size=128", "model.seq_len=16", "model.vocab_size=128"]


@pytest.mark.slow
def test_train_logs_measured_and_simulated_figures(tmp_path, mlflow_store, monkeypatch, capsys) -> None:
    args = [
        # At width 32 the model's own holds (`Tensor.held_until`) put half the keep-all peak out of reach.
        "model=hf_gpt2_2l", *SMALL, "planner=slackswap", "budget.fraction=0.7", "train.steps=2", "train.device=cpu",
        f"tracking.uri={mlflow_store.uri}", f"tracking.artifact_location={mlflow_store.artifact_root}",
        "tracking.experiment=test", f"hydra.run.dir={tmp_path}/run",
        "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
    ]
    _run_cli(monkeypatch, args, module="pipelines.train")
    out = capsys.readouterr().out
    assert "step 1/2" in out and "step 2/2" in out  # progress
    figures = json.loads((tmp_path / "run" / "train.json").read_text())
    assert figures["status"] == "ok" and figures["grad_check_bit_exact"] is True
    assert figures["counts_equal_plan"] is True
    assert figures["plan_offloads"] > 0  # the budget binds: the plan swaps
    # Every device storage of the step, measured, equals the simulated peak on the CPU's link, within budget.
    assert figures["measured_peak_bytes"] == figures["sim_peak_activation_bytes_device_link"]
    assert figures["measured_equals_sim"] is True and figures["measured_within_budget"] is True
    assert figures["measured_peak_bytes"] <= figures["budget_bytes"]
    assert figures["ledger_missing_copies"] == 0
    assert figures["check_ledger_peak_bytes"] == figures["ledger_plan_bytes_at_peak"] + figures["ledger_late_bytes"]
    run = mlflow_store.client().search_runs([mlflow_store.client().get_experiment_by_name("test").experiment_id])[0]
    metrics = run.data.metrics
    for key in ("measured_step_s", "measured_peak_bytes", "sim_peak_activation_bytes",
                "sim_peak_activation_bytes_device_link", "measured_equals_sim", "ledger_peak_bytes", "sim_step_s",
                "sim_saved_peak_bytes", "grad_check_bit_exact"):
        assert key in metrics, key
    assert metrics["grad_check_bit_exact"] == 1 and metrics["measured_equals_sim"] == 1
    assert run.info.status == "FINISHED"
    # As pipelines.run: the run folder and id at the end, sizes in a readable unit, the right source,
    # the versions it ran with, no empty log file.
    assert f"[train] run dir {tmp_path / 'run'}" in out and f"[train] mlflow run {run.info.run_id}" in out
    assert " B," not in out and " B (" not in out and ("MiB" in out or "KiB" in out)
    tags = run.data.tags
    assert tags["mlflow.source.name"] == "pipelines/train.py" and tags["status"] == "ok"
    assert tags["version.torch"] == figures["versions"]["torch"] != "not installed"
    assert not list((tmp_path / "run").glob("*.log"))


def test_train_rejects_an_analytic_preset(tmp_path, monkeypatch) -> None:
    from slackswap.errors import ConfigError

    args = ["model=tiny", "tracking=off", f"hydra.run.dir={tmp_path}/run", "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled"]
    with pytest.raises(ConfigError, match="model.torch"):
        _run_cli(monkeypatch, args, module="pipelines.train")


def test_train_rejects_an_unknown_executor(tmp_path, monkeypatch) -> None:
    from slackswap.errors import ConfigError

    args = ["model=hf_gpt2_2l", "train.executor=jit", "tracking=off", f"hydra.run.dir={tmp_path}/run",
            "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    with pytest.raises(ConfigError, match=r"train.executor.*jit.*eager"):
        _run_cli(monkeypatch, args, module="pipelines.train")


@pytest.mark.slow
def test_train_runs_the_plan_compiled(tmp_path, monkeypatch, capsys) -> None:
    """train.executor=compile: the plan exported to selective checkpointing, each layer compiled."""
    args = ["model=hf_gpt2_2l", *SMALL, "planner=slackswap", "budget.fraction=0.7", "train.steps=2",
            "train.executor=compile",
            "tracking=off", f"hydra.run.dir={tmp_path}/run", "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled"]
    _run_cli(monkeypatch, args, module="pipelines.train")
    figures = json.loads((tmp_path / "run" / "train.json").read_text())
    assert figures["status"] == "ok" and len(figures["losses"]) == 2
    assert figures["grad_check_max_abs_diff"] < 1.0  # compiled numerics and RNG: close, not equal
    assert figures["export_differences"] == len(figures["export_difference_tensors"])
    assert figures["export_static_differences"] == 0  # the plan is made for the export (plan_for_export)
    # Made for the compiled export: every difference is a layer's output held outside the partition, none
    # a dropout mask saved in another form than planned (bool under compile, planned so).
    assert set(figures["export_differences_by_reason"]) <= {"the compiled layer's output"}
    assert "executor=compile" in capsys.readouterr().out
