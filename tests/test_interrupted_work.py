"""An interrupt of a single run, a training or an advice says what it ended and where its output is,
and an interrupted advice keeps the configurations it evaluated (docs/pipeline.md, "Faults").

In this process: the interrupt is raised where a signal would land (inside the stage that runs), under
the CLI's own handlers, so the lines and the MLflow statuses are the product's."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path

from pipelines import faults
from tests.cli_support import run_cli_in_process
from tests.extras import require_torch_extra


def _store_args(store) -> list[str]:
    return [f"tracking.uri={store.uri}", f"tracking.artifact_location={store.artifact_root}",
            "tracking.experiment=test", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled"]


def _statuses(db: Path) -> list[str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return sorted(row[0] for row in conn.execute("SELECT status FROM runs"))


def _interrupt(*args, **kwargs):
    raise faults.Interrupted(signal.SIGINT)


def _err_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip() and " INFO mlflow" not in line]


def test_an_interrupted_single_run_counts_its_killed_run_and_names_its_folder(
    tmp_path, mlflow_store, monkeypatch, capsys
) -> None:
    """The job marks its own run KILLED as the interrupt unwinds it: the line counted 0 of them."""
    import pipelines.job

    monkeypatch.setattr(pipelines.job, "run_stages", _interrupt)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    code = run_cli_in_process(monkeypatch, "pipelines.run",
                              ["model=tiny", *_store_args(mlflow_store), f"hydra.run.dir={run_dir}"])
    assert code == 130
    assert _err_lines(capsys) == [f"interrupted by SIGINT; 1 MLflow run(s) marked KILLED; output in {run_dir}"]
    assert _statuses(mlflow_store.db_path) == ["KILLED"]
    assert json.loads((run_dir / "run_record.json").read_text())["status"] == "killed"


def test_an_interrupted_training_names_its_folder(tmp_path, mlflow_store, monkeypatch, capsys) -> None:
    require_torch_extra()
    import slackswap.experiment.training_run

    monkeypatch.setattr(slackswap.experiment.training_run, "run_training", _interrupt)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    code = run_cli_in_process(monkeypatch, "pipelines.train",
                              ["model=tiny_torch", *_store_args(mlflow_store), f"hydra.run.dir={run_dir}"])
    assert code == 130
    assert _err_lines(capsys) == [f"interrupted by SIGINT; 1 MLflow run(s) marked KILLED; output in {run_dir}"]
    assert _statuses(mlflow_store.db_path) == ["KILLED"]


def test_an_interrupted_advice_keeps_the_configurations_it_evaluated(
    tmp_path, mlflow_store, monkeypatch, capsys
) -> None:
    """Every evaluated configuration reaches advice_partial.jsonl as it is evaluated (it was all lost:
    52 of 94 in the issue's run); a finished advice removes it (advice.json has every row)."""
    import slackswap.experiment.advise as library

    search = library.run_search

    def interrupted_after_three(*args, on_row, **kwargs):
        def row_then_interrupt(i, n, row):
            on_row(i, n, row)
            if i == 3:
                raise faults.Interrupted(signal.SIGINT)

        return search(*args, on_row=row_then_interrupt, **kwargs)

    monkeypatch.setattr(library, "run_search", interrupted_after_three)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    args = ["model=tiny", *_store_args(mlflow_store), f"hydra.run.dir={run_dir}", "advise.micro_batches=[1,2]",
            "advise.recipes=[adamw_mixed]", "advise.planners=[keep_all,full_recompute]", "advise.gpus=[1]"]
    assert run_cli_in_process(monkeypatch, "pipelines.advise", args) == 130
    partial = run_dir / "advice_partial.jsonl"
    assert _err_lines(capsys) == [
        f"interrupted by SIGINT; 3 configuration(s) evaluated so far kept in {partial}; "
        f"1 MLflow run(s) marked KILLED; output in {run_dir}"
    ]
    rows = [json.loads(line) for line in partial.read_text().splitlines()]
    assert len(rows) == 3 and all("tokens_per_s" in row and "planner" in row for row in rows)
    assert _statuses(mlflow_store.db_path) == ["KILLED"]

    monkeypatch.setattr(library, "run_search", search)
    assert run_cli_in_process(monkeypatch, "pipelines.advise", args) == 0
    assert not partial.exists() and json.loads((run_dir / "advice.json").read_text())["evaluated"] > 3
