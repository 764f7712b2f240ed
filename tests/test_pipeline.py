"""End to end through Hydra and MLflow: one single run, one multirun with an infeasible and a failing
job, and the error path of a senseless value. Everything goes to tmp_path (run dirs, sweep dirs, the
MLflow database and its artifacts); the tests check that with the paths MLflow reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines import tracking
from pipelines.job import PARENT_FILE, RECORD_FILE, RESOLVED_CONFIG_FILE
from slackswap.metrics_table import names as metric_names
from tests.cli_support import run_cli_in_process
from tests.extras import require_torch_extra

RUN_FILES = ("profile.csv", "graph.json", "plan.json", "metrics.json", "trace.json", "timeline.png")
#: docs/contract.md's "at least" list (tests/test_metrics_table.py checks the doc against the table).
CONTRACT_METRICS = metric_names(contract=True)


def _common(tmp_path: Path, store) -> list[str]:
    return [
        "model=tiny",
        f"tracking.uri={store.uri}",
        f"tracking.artifact_location={store.artifact_root}",
        "tracking.experiment=test",
        f"hydra.run.dir={tmp_path}/run",
        f"hydra.sweep.dir={tmp_path}/sweep",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]


def _run_cli(monkeypatch: pytest.MonkeyPatch, args: list[str], module: str = "pipelines.run") -> int:
    """Run the CLI in this process with HYDRA_FULL_ERROR (the real exception is raised instead of
    sys.exit(1)); returns its exit code."""
    return run_cli_in_process(monkeypatch, module, args, full_error=True)


def _artifact_files(run, store) -> set[str]:
    """The run's artifacts as stored on disk (a sqlite client cannot list `mlflow-artifacts:` URIs;
    the UI serves them from `--artifacts-destination`, see test_moved_store_still_serves_artifacts)."""
    folder = tracking.local_artifact_dir(run.info.artifact_uri, store.artifact_root)
    assert folder is not None and folder.resolve().is_relative_to(store.artifact_root.resolve())
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def _no_absolute_paths(params: dict[str, str]) -> None:
    offending = {k: v for k, v in params.items() if v.startswith("/") or "://" in v}
    assert not offending, offending


@pytest.mark.slow
def test_single_run_writes_files_and_one_mlflow_run(tmp_path, mlflow_store, monkeypatch, capsys) -> None:
    assert _run_cli(monkeypatch, [*_common(tmp_path, mlflow_store), "planner=slackswap", "budget.fraction=0.5"]) == 0
    out = capsys.readouterr().out
    assert "throughput" in out and "tiny" in out

    run_dir = tmp_path / "run"
    for name in (*RUN_FILES, RESOLVED_CONFIG_FILE, RECORD_FILE):
        assert (run_dir / name).is_file(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert set(CONTRACT_METRICS) <= set(metrics)
    assert metrics["feasible"] is True and 0 < metrics["throughput_ratio"] <= 1
    assert metrics["budget_bytes"] == int(0.5 * metrics["keep_all_peak_bytes"])
    assert metrics["peak_activation_bytes"] <= metrics["budget_bytes"]

    client = mlflow_store.client()
    experiment = client.get_experiment_by_name("test")
    assert experiment.artifact_location == "mlflow-artifacts:/test"  # no path of this machine
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "slackswap · tiny · a100_80gb_pcie4 · 0.5"
    assert run.data.tags["status"] == "ok" and "reason" not in run.data.tags
    assert "throughput" in run.data.tags["mlflow.note.content"]
    assert run.data.tags["choice.model"] == "tiny" and run.data.tags["choice.planner"] == "slackswap"
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40 and run.data.tags["slackswap_version"]
    assert run.data.tags["mlflow.source.name"] == "pipelines/run.py" and run.data.tags["mlflow.user"]
    assert run.data.params["model.num_layers"] == "2"  # a single run has no parent: every param is here
    assert run.data.params["hardware.link.name"] and run.data.params["planner"] == "slackswap"
    assert float(run.data.params["budget.fraction"]) == 0.5
    assert not any(k.startswith("tracking.") for k in run.data.params)
    _no_absolute_paths(run.data.params)
    assert {(d.dataset.name, d.tags[0].value) for d in run.inputs.dataset_inputs} == {
        ("tiny", "model"),
        ("a100_80gb_pcie4", "hardware"),
    }
    assert run.data.metrics["feasible"] == 1.0
    assert run.data.metrics["throughput_ratio"] == pytest.approx(metrics["throughput_ratio"])
    assert run.data.metrics["fits_device"] == 1.0 and run.data.tags["fits_device"] == "true"
    assert run.data.metrics["tokens_per_s"] == pytest.approx(metrics["tokens_per_s"]) and metrics["tokens_per_s"] > 0
    assert run.data.metrics["mfu"] == pytest.approx(metrics["mfu"]) and metrics["mfu"] > 0
    assert run.data.metrics["throughput_pct"] == pytest.approx(100 * metrics["throughput_ratio"])
    assert run.data.metrics["budget_gib"] == pytest.approx(metrics["budget_bytes"] / 2**30)
    assert {*RUN_FILES, RESOLVED_CONFIG_FILE} <= _artifact_files(run, mlflow_store)
    # Stored once: the artifact is the run directory's file under a second name (a hard link).
    artifact = tracking.local_artifact_dir(run.info.artifact_uri, mlflow_store.artifact_root) / "trace.json"
    assert artifact.stat().st_ino == (run_dir / "trace.json").stat().st_ino
    found = client.search_runs([experiment.experiment_id], "params.`model.name` = 'tiny' and tags.status = 'ok'")
    assert [r.info.run_id for r in found] == [run.info.run_id]


@pytest.mark.slow
def test_a_step_over_the_device_is_ok_but_says_so_on_stdout_and_in_mlflow(tmp_path, mlflow_store, monkeypatch, capsys):
    """README's absolute-budget example: AdamW mixed llama7b on one A100 80 GB meets a 20 GB budget, but
    its 100.41 GiB of static state does not fit the device; it never reads as a plain success."""
    args = [*_common(tmp_path, mlflow_store), "model=llama7b", "budget=absolute", "budget.bytes=20000000000",
            "plots=none"]  # fmt: skip
    assert _run_cli(monkeypatch, args) == 0
    out = capsys.readouterr().out
    status = next(line for line in out.splitlines() if line.startswith("status"))
    assert status.startswith("status       ok; DOES NOT FIT THE DEVICE") and "tokens/s" in out
    speed = next(line for line in out.splitlines() if line.startswith("speed"))
    assert "(step: forward + backward, without the optimizer step (model.include_optimizer=false)" in speed
    client = mlflow_store.client()
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert run.data.tags["status"] == "ok" and run.data.tags["fits_device"] == "false"
    assert run.data.metrics["fits_device"] == 0.0 and run.data.metrics["headroom_bytes"] < 0
    assert "DOES NOT FIT THE DEVICE" in run.data.tags["mlflow.note.content"]


def test_senseless_value_fails_before_any_mlflow_run(tmp_path, mlflow_store, monkeypatch) -> None:
    from slackswap.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _run_cli(monkeypatch, [*_common(tmp_path, mlflow_store), "budget.fraction=1.5"])
    assert info.value.field == "budget.fraction"
    client = mlflow_store.client()
    assert client.get_experiment_by_name("test") is None  # nothing was started
    assert not (tmp_path / "run" / "profile.csv").exists()


@pytest.mark.slow
def test_multirun_records_infeasible_and_failed_jobs_and_aggregates(tmp_path, mlflow_store, monkeypatch, capsys):
    args = [
        "--multirun",
        *_common(tmp_path, mlflow_store),
        "planner=slackswap",
        "planner.name=slackswap,keep_all,no_such_planner",
        "budget.fraction=0.5,1.0",
    ]
    # Two jobs failed (an unknown planner): the sweep completes, then exits non-zero.
    assert _run_cli(monkeypatch, args) == 1
    sweep = tmp_path / "sweep"
    for name in ("summary.csv", "summary.md", "throughput_vs_budget.png", "planner_comparison.png"):
        assert (sweep / name).is_file(), name
    records = {
        (r["planner_name"], r["budget_fraction"]): r
        for r in (json.loads(p.read_text()) for p in sweep.glob(f"*/{RECORD_FILE}"))
    }
    assert len(records) == 6
    assert records[("slackswap", 0.5)]["status"] == "ok"
    assert records[("keep_all", 1.0)]["status"] == "ok"
    # plots=auto in a sweep: the sweep plots above, no per-job timeline.png (docs/pipeline.md, "Plots").
    ok_dir = Path(records[("slackswap", 0.5)]["run_dir"])
    assert (ok_dir / "trace.json").is_file() and not (ok_dir / "timeline.png").exists()
    assert records[("keep_all", 0.5)]["status"] == "infeasible"
    assert "budget" in records[("keep_all", 0.5)]["failure_reason"]
    assert records[("no_such_planner", 0.5)]["status"] == "failed"
    assert "no_such_planner" in records[("no_such_planner", 0.5)]["failure_reason"]

    import pandas as pd

    summary = pd.read_csv(sweep / "summary.csv")
    assert len(summary) == 6
    assert sorted(summary["status"]) == ["failed", "failed", "infeasible", "ok", "ok", "ok"]

    client = mlflow_store.client()
    experiment = client.get_experiment_by_name("test")
    parent_id = json.loads((sweep / PARENT_FILE).read_text())["run_id"]
    parent = client.get_run(parent_id)
    # Two jobs without a result: the parent is FAILED, as the exit code says, and names why.
    assert parent.info.status == "FAILED" and parent.data.tags["status"] == "failed"
    assert parent.data.tags["reason"] == "2 of 6 jobs failed or were killed"
    assert parent.data.metrics["jobs_total"] == 6 and parent.data.metrics["jobs_failed"] == 2
    assert {"summary.csv", "summary.md", "throughput_vs_budget.png"} <= _artifact_files(parent, mlflow_store)
    assert parent.info.run_name.startswith("adhoc · ")
    assert "planner.name" in parent.data.tags["mlflow.note.content"]
    assert "summary.md" in experiment.tags["mlflow.note.content"]
    # Constants once on the parent (the model is the same for every child), none of tracking.*.
    assert parent.data.params["model.num_layers"] == "2" and "budget.fraction" not in parent.data.params
    _no_absolute_paths(parent.data.params)
    children = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert len(children) == 6
    by_status = {}
    for child in children:
        by_status.setdefault(child.data.tags["status"], []).append(child)
        _artifact_files(child, mlflow_store)
        # Planner first, then only what the sweep varies; few params: filter keys + what varies.
        assert child.info.run_name.split(" · ")[0] == child.data.params["planner.name"]
        assert child.info.run_name.split(" · ")[1] == f"{float(child.data.params['budget.fraction']):g}"
        assert set(child.data.params) == {"model", "hardware", "planner", "planner.name", "budget.fraction"}
    assert len(by_status["ok"]) == 3 and len(by_status["infeasible"]) == 1 and len(by_status["failed"]) == 2
    # An infeasible budget is a result: FINISHED, with its reason in the description and a tag.
    infeasible = by_status["infeasible"][0]
    assert infeasible.info.status == "FINISHED"
    assert infeasible.data.tags["reason"] in infeasible.data.tags["mlflow.note.content"]
    assert "Infeasible" in infeasible.data.tags["mlflow.note.content"]
    assert infeasible.data.metrics["feasible"] == 0.0
    assert {"budget_gib", "keep_all_peak_gib", "min_feasible_gib"} <= set(infeasible.data.metrics)
    assert all(c.info.status == "FAILED" for c in by_status["failed"])
    assert "no_such_planner" in by_status["failed"][0].data.tags["reason"]
    out = capsys.readouterr().out
    assert "Sweep summary" in out
    assert f"#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning" in out


@pytest.mark.slow
def test_submitit_local_two_job_sweep(tmp_path, mlflow_store, monkeypatch) -> None:
    """Workers are separate processes: the parent run and the experiment must already exist for them."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from pipelines.schemas import REPO_ROOT

    # Worker processes import `pipelines` by module path; give them the repository like pytest has it.
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    args = [
        "--multirun",
        *_common(tmp_path, mlflow_store),
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=5",
        "planner=keep_all",
        "budget.fraction=1.0,0.5",
    ]
    _run_cli(monkeypatch, args)
    sweep = tmp_path / "sweep"
    statuses = sorted(json.loads(p.read_text())["status"] for p in sweep.glob(f"*/{RECORD_FILE}"))
    assert statuses == ["infeasible", "ok"]
    assert (sweep / "summary.csv").is_file()
    client = mlflow_store.client()
    parent_id = json.loads((sweep / PARENT_FILE).read_text())["run_id"]
    experiment = client.get_experiment_by_name("test")
    children = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert sorted(c.data.tags["status"] for c in children) == ["infeasible", "ok"]
    assert client.get_run(parent_id).info.status == "FINISHED"


def test_profile_cli_prints_breakdown_and_writes_files(tmp_path, monkeypatch, capsys) -> None:
    args = ["model=tiny", f"hydra.run.dir={tmp_path}/profile", "hydra/job_logging=disabled"]
    _run_cli(monkeypatch, args, module="pipelines.profile")
    out = capsys.readouterr().out
    assert "tiny" in out
    rows = (tmp_path / "profile" / "profile.csv").read_text().splitlines()
    assert rows[0] == "layer,saved_bytes,fwd_flops,bwd_flops,fwd_s,bwd_s,formula_saved_bytes,saved_ratio"
    assert len(rows) == 1 + 2  # header + the tiny preset's two layers
    assert json.loads((tmp_path / "profile" / "graph.json").read_text())


def test_profile_cli_names_a_bad_value_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys) -> None:
    """In this process (the exit code is what `cli()` returns to `sys.exit`; no interpreter start-up)."""
    args = ["model=tiny", "model.num_layers=-3", f"hydra.run.dir={tmp_path}"]
    code = run_cli_in_process(monkeypatch, "pipelines.profile", args)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert err.strip() == "error: model.num_layers=-3: must be an integer >= 1"
    assert not (tmp_path / "profile.csv").exists()


@pytest.mark.slow
def test_traced_model_runs_end_to_end_and_logs_real_vs_analytic(tmp_path, mlflow_store, monkeypatch, capsys) -> None:
    """The torch profile source through Hydra and MLflow (TinyGPT: no transformers download, seconds)."""
    require_torch_extra("torch")
    common = [a for a in _common(tmp_path, mlflow_store) if a != "model=tiny"]
    args = [*common, "model=tiny_torch", "planner=slackswap", "budget.fraction=0.5"]
    _run_cli(monkeypatch, args)
    out = capsys.readouterr().out
    assert "real keep-all peak" in out and "analytic" in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["feasible"] is True
    assert metrics["real_to_analytic_peak_ratio"] == metrics["keep_all_peak_bytes"] / metrics[
        "analytic_keep_all_peak_bytes"]
    rows = (tmp_path / "run" / "profile.csv").read_text().splitlines()
    assert rows[0].endswith("formula_saved_bytes,saved_ratio") and len(rows) == 3
    assert all(float(r.split(",")[-1]) > 1.0 for r in rows[1:])  # real layers keep more than the formula
    client = mlflow_store.client()
    run = client.search_runs([client.get_experiment_by_name("test").experiment_id])[0]
    assert run.data.tags["status"] == "ok"
    assert run.data.metrics["real_to_analytic_peak_ratio"] == pytest.approx(metrics["real_to_analytic_peak_ratio"])
    assert run.data.params["model.torch.builder"] == "tiny_gpt"


def test_verify_torch_cli_on_the_cpu_path(tmp_path, monkeypatch, capsys) -> None:
    """The GPU check script (pipelines.verify_torch), run on its CPU path: trace = real run, exit 0."""
    require_torch_extra("torch")
    args = ["model=tiny_torch", "+device=cpu", f"hydra.run.dir={tmp_path}/verify", "hydra/job_logging=disabled"]
    _run_cli(monkeypatch, args, module="pipelines.verify_torch")
    assert "EQUAL" in capsys.readouterr().out
    result = json.loads((tmp_path / "verify" / "verify_torch.json").read_text())
    assert result["equal"] is True and result["semantics"] == "cpu" and result["traced"] == result["real"]


def test_a_shared_node_plans_at_the_shared_link_and_pinned_memory_is_a_constraint(tmp_path, monkeypatch) -> None:
    common = ["model=tiny", "tracking=off", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
              "planner=slackswap", "node=dgx_a100", "plots=none"]
    assert _run_cli(monkeypatch, [*common, f"hydra.run.dir={tmp_path}/a"]) in (0, None)
    m = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert m["effective_h2d_gbps"] == pytest.approx(25 / 2 * 0.44) and m["h2d_limit"] == "switch_uplink"
    assert m["gpus_per_node"] == 8 and m["alone_throughput_ratio"] >= m["throughput_ratio"]
    assert 0 < m["host_peak_bytes"] <= m["d2h_bytes"] <= m["host_pinned_bytes"]
    assert m["pinned_needed_bytes"] == 8 * m["host_pinned_bytes"]
    # The same plan with too little pinned host memory for 8 ranks: infeasible, the reason names the field.
    small = m["host_pinned_bytes"] * 8 - 1
    args = [*common, f"node.pinned_host_bytes={small}", f"hydra.run.dir={tmp_path}/b"]
    assert _run_cli(monkeypatch, args) in (0, None)
    record = json.loads((tmp_path / "b" / "run_record.json").read_text())
    assert record["status"] == "infeasible" and "node.pinned_host_bytes" in record["failure_reason"]
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["feasible"] is False
