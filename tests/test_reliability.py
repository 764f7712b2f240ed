"""Faults are normal events: concurrent runs on a fresh store, interrupts, failing jobs, unreachable or
broken tracking stores, reruns. Most tests run the CLI as a user would (a subprocess), because exit
codes, signals and what is printed are the behaviour under test."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.schemas import REPO_ROOT

ROUNDS = 10
PROCESSES = 4


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return env | {"PYTHONPATH": str(REPO_ROOT)} | extra


def _base_args(tmp_path: Path, db: Path | None = None) -> list[str]:
    db = db or tmp_path / "mlflow" / "mlflow.db"
    return [
        "model=tiny",
        f"tracking.uri=sqlite:///{db}",
        f"tracking.artifact_location={tmp_path / 'mlflow' / 'artifacts'}",
        "tracking.experiment=test",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]


def _cli(tmp_path: Path, *args: str, timeout: float = 180, module: str = "pipelines.run", **env: str):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=tmp_path,
        env=_cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---------------------------------------------------------------------------------------- concurrency


def _open_and_log(uri: str, artifact_root: str, barrier, results, index: int) -> None:
    from pipelines import tracking

    try:
        barrier.wait(60)
        client = tracking.open_client(uri)
        experiment_id = tracking.ensure_experiment(client, "stress", artifact_root)
        run_id = tracking.start_run(client, experiment_id, f"process-{index}", {}, None)
        tracking.log_metrics(client, run_id, {"index": index})
        tracking.end_run(client, run_id, ok=True)
        results.put(("ok", run_id))
    except BaseException as exc:  # reported to the test, which fails with it
        results.put(("error", f"{type(exc).__name__}: {str(exc)[:300]}"))


@pytest.mark.slow
def test_four_processes_on_a_fresh_store_ten_times_lose_no_run(tmp_path) -> None:
    """The store setup of the pipeline (open_client + ensure_experiment), not a whole job: forked
    processes start with everything imported, so a round costs one schema creation (~1.3 s)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs the fork start method for cheap processes")
    import mlflow.tracking  # noqa: F401  (imported once here, inherited by every forked process)

    from pipelines import tracking

    ctx = multiprocessing.get_context("fork")
    errors = []
    for round_no in range(ROUNDS):
        folder = tmp_path / f"round{round_no}"
        uri = f"sqlite:///{folder / 'mlflow.db'}"
        barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
        procs = [
            ctx.Process(target=_open_and_log, args=(uri, str(folder / "artifacts"), barrier, results, i))
            for i in range(PROCESSES)
        ]
        for proc in procs:
            proc.start()
        outcomes = [results.get(timeout=180) for _ in procs]
        for proc in procs:
            proc.join(60)
        errors += [f"round {round_no}: {text}" for status, text in outcomes if status == "error"]
        run_ids = {text for status, text in outcomes if status == "ok"}

        with sqlite3.connect(folder / "mlflow.db") as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        client = tracking.open_client(uri)  # a later process can still open it (schema at head)
        experiments = [e for e in client.search_experiments() if e.name == "stress"]
        assert len(experiments) == 1
        runs = client.search_runs([experiments[0].experiment_id])
        assert {r.info.run_id for r in runs} == run_ids
        assert all(r.info.status == "FINISHED" for r in runs)
    assert not errors, errors


@pytest.mark.slow
def test_two_pipeline_runs_at_once_on_a_fresh_store(tmp_path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pipelines.run", *_base_args(tmp_path), f"planner={planner}",
             f"hydra.run.dir={tmp_path / planner}"],
            cwd=tmp_path, env=_cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for planner in ("slackswap", "capuchin")
    ]
    outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("test")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.tags["choice.planner"] for r in runs) == ["capuchin", "slackswap"]
    assert all(r.info.status == "FINISHED" for r in runs)
