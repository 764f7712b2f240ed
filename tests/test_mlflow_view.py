"""How runs read in the MLflow UI (pipelines/presentation.py, pipelines/tracking.py): names, params,
descriptions, units, status mapping, artifacts stored once, and a store that survives being moved."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from pipelines import presentation, tracking
from pipelines.records import RunRecord, RunStatus

RESOLVED = {
    "model": {"name": "gpt2_xl", "num_layers": 48},
    "hardware": {"name": "a100"},
    "planner": {"name": "slackswap", "options": {}},
    "budget": {"fraction": 0.5, "bytes": None},
    "tracking": {"uri": "sqlite:////home/me/repo/mlflow.db", "artifact_location": "/home/me/repo/mlruns"},
}
CHOICES = {"model": "gpt2_xl", "hardware": "a100_80gb_pcie4", "planner": "slackswap", "budget": "half"}


def test_run_name_is_planner_first_and_only_what_varies() -> None:
    assert presentation.run_name(["model", "planner", "budget.fraction"], CHOICES, RESOLVED) == (
        "slackswap · gpt2_xl · 0.5"
    )
    assert presentation.run_name(["model", "planner"], CHOICES, RESOLVED) == "slackswap · gpt2_xl"
    assert presentation.run_name(None, CHOICES, RESOLVED) == "slackswap · gpt2_xl · a100_80gb_pcie4 · 0.5"
    absolute = RESOLVED | {"budget": {"fraction": None, "bytes": 3 * 2**30}}
    assert presentation.run_name(["budget.bytes"], CHOICES, absolute) == "3 GiB"
    # A swept leaf outside the groups shows its value; the planner still leads.
    assert presentation.run_name(["model.num_layers", "planner"], CHOICES, RESOLVED) == "slackswap · 48"


def test_sweep_keys_follow_hydra_sweeper_rules() -> None:
    params = {"model": "bert_large,gpt2_xl,llama7b", "planner": "glob(*,exclude=keep_all)"}
    task = ["+experiment=paper", "tracking.uri=sqlite:///x.db", "budget.fraction=0.3,0.5", "hydra/launcher=joblib"]
    assert presentation.sweep_keys(task, params) == ["model", "planner", "budget.fraction"]
    # A plain command-line value of a swept key wins: `model=gpt2_xl` makes the model constant.
    assert presentation.sweep_keys(["model=gpt2_xl"], params) == ["planner"]


def test_split_params_constant_once_varying_per_child() -> None:
    jobs = [
        {"model.name": "bert", "hardware.name": "a100", "planner.name": "slackswap"},
        {"model.name": "gpt2", "hardware.name": "a100", "planner.name": "milp", "planner.options.x": "1"},
    ]
    constant, varying = presentation.split_params(jobs)
    assert constant == {"hardware.name": "a100"}
    assert varying == {"model.name", "planner.name", "planner.options.x"}  # present on one child only
    flat = tracking.flatten_params(RESOLVED)
    assert not any(k.startswith("tracking.") for k in presentation.config_params(flat))
    assert presentation.filter_params(CHOICES, "slackswap", RESOLVED) == {
        "model": "gpt2_xl",
        "hardware": "a100_80gb_pcie4",
        "planner": "slackswap",
        "budget.fraction": "0.5",
    }


def test_units_percent_and_gib_beside_the_raw_metrics() -> None:
    out = presentation.with_units({"throughput_ratio": 0.9969, "budget_bytes": 3 * 2**30, "feasible": True})
    assert out["throughput_pct"] == pytest.approx(99.69) and out["throughput_ratio"] == 0.9969
    assert out["budget_gib"] == 3.0 and out["budget_bytes"] == 3 * 2**30
    assert "feasible_gib" not in out and "throughput_pct" not in presentation.with_units({"feasible": False})
    assert presentation.size_text(1.5 * 2**30) == "1.500 GiB"
    # A toy model's sizes keep their digits (not "0.000 GiB").
    assert presentation.size_text(420_000) == "0.401 MiB" and presentation.size_text(None) == "n/a"


def test_status_mapping_infeasible_is_a_finished_run() -> None:
    mapping = tracking.MLFLOW_STATUS
    assert mapping["infeasible"] == mapping["ok"] == "FINISHED"
    assert (mapping["failed"], mapping["killed"]) == ("FAILED", "KILLED")


def test_descriptions_say_the_outcome_and_what_is_known() -> None:
    record = RunRecord(
        run_name="keep_all gpt2_xl",
        choices={},
        model="gpt2_xl",
        hardware="a100",
        planner="keep_all",
        planner_name="keep_all",
        budget_fraction=0.5,
        budget_bytes_requested=None,
        run_dir="run",
        status=RunStatus.INFEASIBLE,
        failure_reason="planner: needs 2.0 GiB",
        metrics={"budget_bytes": 2**30, "keep_all_peak_bytes": 2**31, "min_feasible_bytes": 3 * 2**29},
    )
    text = presentation.child_description(record, RESOLVED)
    assert "Infeasible" in text and "planner: needs 2.0 GiB" in text
    assert "1.000 GiB" in text and "2.000 GiB" in text and "1.500 GiB" in text
    assert "ui.perfetto.dev" in text
    note = presentation.sweep_description(
        {"name": "paper", "description": "Seed table", "paper_reference": {"gpt2_xl": 0.976}, "paper_source": "talk"},
        {"model": "bert_large, gpt2_xl"},
        parent_link="#/experiments/1/runs/abc/artifacts/paper_table.md",
    )
    assert "Seed table" in note and "`model`: bert_large, gpt2_xl" in note and "97.6 %" in note
    assert "(#/experiments/1/runs/abc/artifacts/paper_table.md)" in note


def test_a_sweep_description_stays_under_mlflows_limit_and_never_cuts_the_table() -> None:
    """MLflow cut the parent's Description at 8,000 characters mid-table (`hardware`, `budget_curves`):
    a table that does not fit is replaced by a link to the artifact that holds it whole."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    assert presentation.DESCRIPTION_MAX_CHARS == MAX_TAG_VAL_LENGTH
    experiment = {"name": "hardware", "description": "Every GPU"}
    link = "#/experiments/1/runs/abc/artifacts/summary.md"
    rows = [f"| model{i} | h100 | 50% | slackswap | ok | 97.{i % 10}% |" for i in range(300)]
    long_table = "# Sweep summary\n\n| model | hardware | budget | planner | status | throughput |\n" + "\n".join(rows)
    note = presentation.sweep_description(experiment, {"hardware": "a100, h100"}, link, long_table)
    assert len(note) <= MAX_TAG_VAL_LENGTH
    assert "| model0 |" not in note  # no part of the table, rather than a table cut mid-row
    assert f"is longer than MLflow's 8,000-character Description: it is in [the parent's artifacts]({link})" in note
    short_table = "\n".join(long_table.splitlines()[:10])
    note = presentation.sweep_description(experiment, {"hardware": "a100, h100"}, link, short_table)
    assert short_table in note and len(note) <= MAX_TAG_VAL_LENGTH
    many = {f"key{i}": "a, b, c" * 20 for i in range(100)}  # a swept list alone over the limit
    note = presentation.sweep_description(experiment, many, link)
    assert len(note) <= MAX_TAG_VAL_LENGTH and note.rstrip().endswith("list every swept key)")


@pytest.mark.slow
def test_artifacts_are_stored_once_and_survive_moving_the_store(tmp_path, mlflow_store) -> None:
    """Log a run's folder, move the whole store elsewhere, and read the artifact back through the
    handlers `mlflow ui --artifacts-destination <store>/mlruns` serves (in a fresh process)."""
    run_dir = tmp_path / "mlflow" / "outputs" / "run"
    (run_dir / "sub").mkdir(parents=True)
    (run_dir / "timeline.png").write_bytes(b"\x89PNG fake image bytes")
    (run_dir / "sub" / "note.txt").write_text("nested")
    client = mlflow_store.client()
    experiment_id = tracking.ensure_experiment(client, "moved", str(mlflow_store.artifact_root))
    run_id = tracking.create_run(client, experiment_id, "r", {}, None).run_id
    assert tracking.store_artifacts(client, run_id, run_dir, mlflow_store.artifact_root) == 0  # no byte copied
    stored = tracking.local_artifact_dir(client.get_run(run_id).info.artifact_uri, mlflow_store.artifact_root)
    assert (stored / "timeline.png").stat().st_ino == (run_dir / "timeline.png").stat().st_ino
    assert (stored / "sub" / "note.txt").read_text() == "nested"
    tracking.end_run(client, run_id, "ok")

    moved = tmp_path / "elsewhere"
    shutil.move(tmp_path / "mlflow", moved)
    probe = textwrap.dedent(
        f"""
        import json, os
        os.environ["_MLFLOW_SERVER_FILE_STORE"] = "sqlite:///{moved}/mlflow.db"
        os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = "mlflow-artifacts:/"
        os.environ["_MLFLOW_SERVER_SERVE_ARTIFACTS"] = "true"
        os.environ["_MLFLOW_SERVER_ARTIFACT_DESTINATION"] = "{moved}/artifacts"
        from mlflow.server import app
        web = app.test_client()
        listed = web.get("/ajax-api/2.0/mlflow/artifacts/list", query_string={{"run_id": "{run_id}"}})
        image = web.get("/get-artifact", query_string={{"path": "timeline.png", "run_uuid": "{run_id}"}})
        print(json.dumps({{"files": sorted(f["path"] for f in listed.get_json()["files"]),
                          "status": image.status_code, "image": image.data.decode("latin-1")}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    served = json.loads(out.stdout.strip().splitlines()[-1])
    assert served["files"] == ["sub", "timeline.png"]
    assert served["status"] == 200 and served["image"] == "\x89PNG fake image bytes"
