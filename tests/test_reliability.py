"""Faults are normal events: failing jobs, unreachable or broken tracking stores, interrupted store
writes, reruns (concurrent processes, signals and a real server: tests/test_reliability_processes.py).
Most tests run the CLI as a user would (a subprocess), because exit codes and what is printed are the
behaviour under test."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from pipelines.schemas import REPO_ROOT
from tests.cli_support import run_cli_in_process
from tests.reliability_support import _base_args, _cli

# ------------------------------------------------------------------------ failures: one line, no trace


def _in_process(monkeypatch, tmp_path: Path, *args: str, module: str = "pipelines.run", full_error: bool = False):
    """The CLI in this process (no interpreter start-up): returns the exit code."""
    return run_cli_in_process(monkeypatch, module, args, full_error=full_error)


@pytest.mark.parametrize(
    ("override", "field", "value"),
    [
        (["budget.fraction=-0.5"], "budget.fraction", "-0.5"),
        (["budget=absolute"], "budget", "None"),
        (["hardware=v100_pcie3"], "model.dtype", "bf16"),
        (["planner.name=no_such_planner"], "planner.name", "no_such_planner"),
        (["+planner.options.no_such_option=1"], "planner.options", "no_such_option"),
    ],
)
def test_config_value_error_is_one_line_before_any_work(
    tmp_path, mlflow_store, monkeypatch, capsys, override, field, value
) -> None:
    run_dir = tmp_path / "run"
    args = [*_base_args(tmp_path, mlflow_store.db_path), f"hydra.run.dir={run_dir}", *override]
    assert _in_process(monkeypatch, tmp_path, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert field in err[0] and value in err[0]
    # The folder says why it exists; no stage ran (no profile), no MLflow run was started.
    record = json.loads((run_dir / "run_record.json").read_text())
    assert record["status"] == "failed" and field in record["failure_reason"]
    assert not (run_dir / "profile.csv").exists()
    assert mlflow_store.client().get_experiment_by_name("test") is None


def test_full_error_keeps_the_traceback(tmp_path, mlflow_store, monkeypatch) -> None:
    from slackswap.errors import ConfigError

    args = [*_base_args(tmp_path, mlflow_store.db_path), f"hydra.run.dir={tmp_path}/run", "budget.fraction=-0.5"]
    with pytest.raises(ConfigError):
        _in_process(monkeypatch, tmp_path, *args, full_error=True)


def _broken_preset(tmp_path: Path) -> Path:
    """A model preset without `hidden_size`: the config composes, the job cannot resolve it."""
    conf = tmp_path / "extra_conf" / "model"
    conf.mkdir(parents=True)
    lines = (REPO_ROOT / "conf" / "model" / "tiny.yaml").read_text().splitlines()
    kept = [line for line in lines if not line.startswith("hidden_size:")]
    assert len(kept) == len(lines) - 1
    (conf / "tiny_no_hidden.yaml").write_text("\n".join(kept) + "\n")
    return conf.parent


def test_a_job_with_a_missing_preset_value_fails_alone_and_the_sweep_exits_1(
    tmp_path, mlflow_store, monkeypatch, capsys
) -> None:
    extra = _broken_preset(tmp_path)
    sweep = tmp_path / "sweep"
    args = [
        "--multirun", *_base_args(tmp_path, mlflow_store.db_path), f"hydra.sweep.dir={sweep}",
        f"hydra.searchpath=[file://{extra}]", "model=tiny,tiny_no_hidden", "planner=keep_all", "budget.fraction=1.0",
    ]  # fmt: skip
    assert _in_process(monkeypatch, tmp_path, *args) == 1
    out = capsys.readouterr()
    records = {r["model"]: r for r in (json.loads(p.read_text()) for p in sweep.glob("*/run_record.json"))}
    assert records["tiny"]["status"] == "ok"
    assert records["tiny_no_hidden"]["status"] == "failed"
    assert "hidden_size" in records["tiny_no_hidden"]["failure_reason"]
    assert (sweep / "summary.md").is_file() and "[2/2" in out.out
    assert "1 of 2 jobs failed" in out.err
    client = mlflow_store.client()
    parent_id = json.loads((sweep / "mlflow_parent.json").read_text())["run_id"]
    # The sweep ran to its end, but not every job has a result: the parent says so, as the exit code.
    parent = client.get_run(parent_id)
    assert parent.info.status == "FAILED" and parent.data.tags["status"] == "failed"
    assert parent.data.tags["reason"] == "1 of 2 jobs failed or were killed"
    children = client.search_runs([client.get_experiment_by_name("test").experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent_id}'")  # fmt: skip
    assert sorted(c.data.tags["status"] for c in children) == ["failed", "ok"]


def test_infeasible_jobs_alone_do_not_fail_the_sweep(tmp_path, mlflow_store, monkeypatch) -> None:
    args = [
        "--multirun", *_base_args(tmp_path, mlflow_store.db_path), f"hydra.sweep.dir={tmp_path}/sweep",
        "planner=keep_all", "budget.fraction=0.5,1.0",
    ]  # fmt: skip
    assert _in_process(monkeypatch, tmp_path, *args) == 0


def test_logging_failure_marks_the_run_failed_not_ok(tmp_path, mlflow_store, monkeypatch, capsys) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("artifacts cannot go under a file\n")
    run_dir = tmp_path / "run"
    args = [
        *_base_args(tmp_path, mlflow_store.db_path), f"hydra.run.dir={run_dir}",
        f"tracking.artifact_location={not_a_folder}/artifacts", "planner=keep_all", "budget.fraction=1.0",
    ]  # fmt: skip
    code = _in_process(monkeypatch, tmp_path, *args)
    assert code not in (0, None)
    record = json.loads((run_dir / "run_record.json").read_text())
    assert record["status"] == "failed" and "MLflow logging failed" in record["failure_reason"]
    client = mlflow_store.client()
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["status"] == "failed"


@pytest.mark.parametrize("kind", ["garbage", "foreign"])
def test_broken_store_is_reported_once_with_its_path_before_any_job(tmp_path, monkeypatch, capsys, kind) -> None:
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    if kind == "garbage":
        db.write_bytes(b"this is not a database" * 100)
    else:
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE invoices (id INTEGER)")
    sweep = tmp_path / "sweep"
    args = ["--multirun", *_base_args(tmp_path, db), f"hydra.sweep.dir={sweep}", "budget.fraction=0.5,1.0"]
    assert _in_process(monkeypatch, tmp_path, *args) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and str(db) in err[0] and "Traceback" not in err[0], err
    assert not any(p.is_dir() for p in sweep.glob("[0-9]*")), "no job may launch"
    if kind == "foreign":
        with sqlite3.connect(db) as conn:  # and nothing was added to someone else's database
            assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")] == ["invoices"]


@pytest.mark.slow
def test_unreachable_server_fails_fast_naming_the_uri(tmp_path) -> None:
    """Port 9 (discard) on 127.0.0.1 has no server. MLflow alone retried for about 4 minutes."""
    uri = "http://127.0.0.1:9"
    done = _cli(tmp_path, "model=tiny", "tracking=server", f"tracking.uri={uri}", f"hydra.run.dir={tmp_path}/run",
                "hydra/job_logging=disabled", "hydra/hydra_logging=disabled", timeout=60)  # fmt: skip
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and uri in lines[0] and "Traceback" not in done.stderr, done.stderr


# ------------------------------------------------------------------------------------------ interrupts


def test_an_interrupt_inside_a_store_write_does_not_keep_the_run_running(tmp_path, mlflow_store):
    """An interrupt between a store statement and its commit leaves that connection, with SQLite's
    write lock, in the unwound frames; marking the run KILLED from the handler then failed after the
    busy timeout ("database is locked", seen under load in the SIGINT tests) and the run stayed
    RUNNING. Released first, the half-done write is rolled back and the run is marked at once."""
    import signal

    from sqlalchemy import text

    from pipelines import faults, tracking

    client = tracking.open_client(mlflow_store.uri)
    run = client.create_run(client.create_experiment("e", artifact_location=str(mlflow_store.artifact_root)))
    engine = client._tracking_client.store.engine  # MLflow's SQLAlchemy store: where the lock lives

    def write_interrupted_before_commit():
        connection = engine.connect()
        connection.execute(text("UPDATE runs SET name = 'half-written'"))  # takes the write lock
        raise faults.Interrupted(signal.SIGINT)

    try:
        write_interrupted_before_commit()
    except KeyboardInterrupt as exc:
        faults.release_interrupted_frames(exc)
        assert exc.__traceback__ is None
        faults.kill_run(client, run.info.run_id)
    after = client.get_run(run.info.run_id)
    assert after.info.status == "KILLED" and after.data.tags["status"] == "killed"
    assert after.info.run_name != "half-written"




# ---------------------------------------------------------------------- aggregate, re-running a sweep


def test_aggregate_cli_summarises_a_partial_sweep(tmp_path, mlflow_store, monkeypatch, capsys) -> None:
    sweep = tmp_path / "sweep"
    # The sweep draws no plots of its own (`plots=none`): the aggregate CLI's are the ones under test.
    args = ["--multirun", *_base_args(tmp_path, mlflow_store.db_path), f"hydra.sweep.dir={sweep}",
            "planner=keep_all", "budget.fraction=1.0,0.5", "plots=none"]  # fmt: skip
    assert _in_process(monkeypatch, tmp_path, *args) == 0
    for name in ("summary.md", "summary.csv"):
        (sweep / name).unlink()
    (sweep / "1" / "run_record.json").unlink()  # as if job 1 never finished
    (sweep / "2").mkdir()  # a job that started and left nothing
    capsys.readouterr()
    assert _in_process(monkeypatch, tmp_path, str(sweep), module="pipelines.aggregate") == 0
    assert "1 of 2 jobs: 1 ok; 1 missing (no run_record.json)" in (sweep / "summary.md").read_text()
    assert "Sweep summary" in capsys.readouterr().out
    # A truncated record (a full disk, a killed writer): the good jobs are summarised, the bad file is
    # named in one line, the exit code says something is wrong.
    good = (sweep / "0" / "run_record.json").read_text()
    (sweep / "2" / "run_record.json").write_text(good[: len(good) // 2])
    assert _in_process(monkeypatch, tmp_path, str(sweep), module="pipelines.aggregate") == 1
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and str(sweep / "2" / "run_record.json") in err[0] and "not valid JSON" in err[0], err
    assert "Traceback" not in out.err and "1 of 2 jobs: 1 ok" in out.out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _in_process(monkeypatch, tmp_path, str(empty), module="pipelines.aggregate") == 1


@pytest.mark.slow
def test_rerunning_a_sweep_into_its_folder_neither_duplicates_nor_loses(
    tmp_path, mlflow_store, monkeypatch, capsys
) -> None:
    sweep = tmp_path / "sweep"
    common = ["--multirun", *_base_args(tmp_path, mlflow_store.db_path), f"hydra.sweep.dir={sweep}",
              "planner=keep_all", "plots=none"]  # fmt: skip
    assert _in_process(monkeypatch, tmp_path, *common, "budget.fraction=1.0,0.5") == 0
    first = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/run_record.json")}
    parent_id = json.loads((sweep / "mlflow_parent.json").read_text())["run_id"]
    client = mlflow_store.client()
    first_parent = client.get_run(parent_id)
    assert first_parent.data.tags["status"] == "ok"  # a completed sweep says so
    capsys.readouterr()
    # Job 1 was killed last time: it is run again, its earlier files set aside, not lost.
    killed = first["1"] | {"status": "killed"}
    (sweep / "1" / "run_record.json").write_text(json.dumps(killed))
    client.set_tag(parent_id, "status", "killed")  # as an interrupt leaves the parent
    client.set_terminated(parent_id, "KILLED")

    assert _in_process(monkeypatch, tmp_path, *common, "budget.fraction=1.0,0.5,0.7") == 0
    second = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/run_record.json")}
    assert sorted(second) == ["0", "1", "2"]
    assert second["0"]["mlflow_run_id"] == first["0"]["mlflow_run_id"]  # kept, not run again
    assert second["1"]["mlflow_run_id"] != first["1"]["mlflow_run_id"]  # re-run
    aside = json.loads((sweep / "superseded" / "1-1" / "run_record.json").read_text())
    assert aside["status"] == "killed"
    assert json.loads((sweep / "mlflow_parent.json").read_text())["run_id"] == parent_id
    children = client.search_runs(
        [client.get_experiment_by_name("test").experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'"
    )
    # The parent's children are the summary's jobs: job 0 once, job 1 again, job 2. Job 1's killed first
    # attempt is set aside, said in one line, and its run deleted from the parent (restorable).
    assert sorted(c.info.run_id for c in children) == sorted(r["mlflow_run_id"] for r in second.values())
    aside_run = client.get_run(first["1"]["mlflow_run_id"])
    assert aside_run.info.lifecycle_stage == "deleted" and aside_run.data.tags["superseded"] == "true"
    parent = client.get_run(parent_id)
    # Completed again: no `killed` left over from the interrupted attempt, time of both runs counted.
    assert parent.info.status == "FINISHED" and parent.data.tags["status"] == "ok"
    assert parent.data.metrics["sweep_wall_s"] > first_parent.data.metrics["sweep_wall_s"]
    # The progress counts this run's jobs 1, 2, 3 (the kept one included), not the records on disk.
    out = capsys.readouterr().out
    counters = [line.split("]")[0] for line in out.splitlines() if line.startswith("[")]
    assert [c.split()[0] for c in counters] == ["[1/3", "[2/3", "[3/3"], counters
    assert f"1 earlier job folder(s) set aside in {sweep / 'superseded'} (1-1): " in out
    assert "their 1 MLflow run(s) deleted from the parent" in out
    import pandas as pd

    assert len(pd.read_csv(sweep / "summary.csv")) == 3


def test_resuming_a_sweep_folder_with_another_grid_says_so_and_the_parent_matches_the_summary(
    tmp_path, mlflow_store, monkeypatch, capsys
) -> None:
    """The issue's case: 4 jobs, then 2 of another grid into the same folder. Jobs 0 and 1 of the first
    grid are set aside (replaced by the new grid's 0 and 1), and one line says so; jobs 2 and 3 keep
    their folders and stay in the summary. The parent lists exactly the summary's children (it kept the
    set-aside runs too: 6 children beside a 4-row summary)."""
    sweep = tmp_path / "sweep"
    common = ["--multirun", *_base_args(tmp_path, mlflow_store.db_path), f"hydra.sweep.dir={sweep}", "plots=none"]
    assert _in_process(monkeypatch, tmp_path, *common, "planner=keep_all,full_recompute",
                       "budget.fraction=1.0,0.9") == 0
    capsys.readouterr()
    assert _in_process(monkeypatch, tmp_path, *common, "planner=swap_only", "budget.fraction=0.8,0.7") == 0
    out = capsys.readouterr().out
    [said] = [line for line in out.splitlines() if "set aside" in line]
    assert said.startswith(f"2 earlier job folder(s) set aside in {sweep / 'superseded'} (0-1, 1-1): another config")
    assert said.endswith("`mlflow runs restore --run-id <id>` brings one back)") and "their 2 MLflow run(s)" in said
    parent_id = json.loads((sweep / "mlflow_parent.json").read_text())["run_id"]
    client = mlflow_store.client()
    children = client.search_runs(
        [client.get_experiment_by_name("test").experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'"
    )
    import pandas as pd

    summary = pd.read_csv(sweep / "summary.csv")
    assert len(summary) == 4 and sorted(c.info.run_id for c in children) == sorted(summary["mlflow_run_id"])


# -------------------------------------------------------------------------------------- determinism

#: metrics.json keeps the contract's two wall-clock fields (docs/contract.md); they are the only lines
#: allowed to differ between two runs of the same config.
WALL_CLOCK_LINES = ('"plan_wall_s"', '"sim_wall_s"')


def _without_wall_clock(path: Path) -> bytes:
    lines = path.read_bytes().splitlines(keepends=True)
    return b"".join(line for line in lines if not any(key.encode() in line for key in WALL_CLOCK_LINES))


def _composing_each_job_once(monkeypatch) -> list[list[str]]:
    """Hydra's per-job composition, kept by the job's command line (the master's overrides and the job's):
    a job composed again gets an unpickled copy of the first composition, with the master's resolver
    cache copied on as Hydra's `load_sweep_config` does. Returns the overrides actually composed."""
    import pickle

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from omegaconf import OmegaConf

    original = ConfigLoaderImpl.load_sweep_config
    kept: dict[tuple, bytes] = {}
    composed: list[list[str]] = []

    def once(self, master_config, sweep_overrides):
        overrides = master_config.hydra.overrides
        key = (tuple(overrides.hydra), tuple(overrides.task), tuple(sweep_overrides))
        if key not in kept:
            composed.append(list(sweep_overrides))
            kept[key] = pickle.dumps(original(self, master_config, sweep_overrides))
        config = pickle.loads(kept[key])
        OmegaConf.copy_cache(from_config=master_config, to_config=config)
        return config

    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config", once)
    return composed


@pytest.mark.slow
def test_same_config_twice_gives_the_same_files(tmp_path, monkeypatch) -> None:
    """Every planner (milp: tests/test_milp.py, its exact solve on tiny takes a minute) and every stage,
    twice from scratch (the per-process profile cache emptied): the same bytes.

    Both sweeps run the same command line into the same folder (moved aside after each), and the
    second gets the first's composed job configs instead of composing them again (18 compositions,
    about 2 s of CPU): what is under test is what the stages make of one config. That composing the
    same overrides twice gives the same config files is tests/test_job_overhead.py's comparison of two
    sweepers. No sweep plots (`plots=none`): none is compared; a one-budget sweep's plots are
    test_one_budget_draws_no_throughput_curve's."""
    from slackswap.experiment import baseline as baselines

    composed = _composing_each_job_once(monkeypatch)
    sweeps = [tmp_path / "first", tmp_path / "second"]
    for sweep in sweeps:
        monkeypatch.setattr(baselines, "_BASELINES", {})
        args = ["--multirun", "model=tiny", "tracking=off", f"hydra.sweep.dir={tmp_path / 'sweep'}", "plots=none",
                "hydra/job_logging=disabled", "planner=glob(*,exclude=milp)", "budget.fraction=0.5"]  # fmt: skip
        assert _in_process(monkeypatch, tmp_path, *args) == 0
        (tmp_path / "sweep").rename(sweep)
    jobs = sorted(p.name for p in sweeps[0].iterdir() if p.name.isdigit())
    assert len(jobs) >= 8
    assert len(composed) == len(jobs)  # each job's config composed by the first sweep, once
    for job in jobs:
        first, second = sweeps[0] / job, sweeps[1] / job
        assert _without_wall_clock(first / "metrics.json") == _without_wall_clock(second / "metrics.json"), job
        for name in ("profile.csv", "graph.json", "plan.json", "trace.json", "config.resolved.yaml"):
            if (first / name).exists():
                assert (first / name).read_bytes() == (second / name).read_bytes(), (job, name)


# -------------------------------------------------------------------------------------- everyday use


def test_a_run_leaves_no_empty_log_and_its_timeline_names_what_it_shows(tmp_path, monkeypatch) -> None:
    """Hydra's default job logging opened an empty slackswap.log in every run folder."""
    run_dir = tmp_path / "run"
    args = ["model=tiny", "tracking=off", f"hydra.run.dir={run_dir}", "planner=capuchin", "plots=all"]
    assert _in_process(monkeypatch, tmp_path, *args) == 0
    assert (run_dir / "timeline.png").is_file()
    assert not [p.name for p in run_dir.rglob("*.log") if p.stat().st_size == 0]

    from pipelines.plots import timeline_title
    from slackswap.budget import Budget
    from slackswap.experiment import RunSpec

    resolved = OmegaConf_to_dict(run_dir / "config.resolved.yaml")
    inputs = RunSpec.from_dict(resolved)
    assert isinstance(inputs.budget, Budget)
    title = timeline_title(inputs, budget_bytes=2**29, keep_all_peak_bytes=2**30)
    for part in (inputs.model.name, inputs.hardware.name, "capuchin", "0.5 GiB", "50%"):
        assert part in title, (part, title)


def OmegaConf_to_dict(path: Path) -> dict:  # noqa: N802  (reads like the OmegaConf call it wraps)
    import yaml

    return yaml.safe_load(path.read_text())


def test_one_budget_draws_no_throughput_curve(tmp_path) -> None:
    """A curve over a single x value (the paper experiment's one budget) says nothing; the bars do."""
    from pipelines import aggregate

    for job, planner in enumerate(("slackswap", "capuchin")):
        (tmp_path / str(job)).mkdir()
        record = {
            "run_name": planner, "choices": {}, "planner_name": planner, "run_dir": str(tmp_path / str(job)),
            "model": "tiny", "hardware": "gpu", "planner": planner, "budget_fraction": 0.5,
            "budget_bytes_requested": None, "status": "ok", "failure_reason": "", "mlflow_run_id": None,
            "metrics": {"keep_all_peak_bytes": 1000, "budget_bytes": 500, "throughput_ratio": 0.9, "step_s": 1.1,
                        "ideal_step_s": 1.0, "feasible": True},
        }  # fmt: skip
        (tmp_path / str(job) / "run_record.json").write_text(json.dumps(record))
    (tmp_path / "throughput_vs_budget.png").write_bytes(b"stale")
    result = aggregate.aggregate_sweep(tmp_path, {})
    assert not (tmp_path / "throughput_vs_budget.png").exists()
    assert (tmp_path / "planner_comparison.png").is_file()
    assert all(p.name != "throughput_vs_budget.png" for p in result.files)


def test_preset_inputs_survive_a_parallel_job_logging_the_same_preset() -> None:
    """Seen with the real server: two joblib workers inserted the same dataset row at once and one
    job failed with `UNIQUE constraint failed: datasets...`."""
    from pipelines import tracking

    class RacingClient:
        calls = 0

        def log_inputs(self, run_id, datasets):
            RacingClient.calls += 1
            if RacingClient.calls == 1:
                raise RuntimeError("UNIQUE constraint failed: datasets.experiment_id, datasets.name")

    tracking.log_presets(RacingClient(), "run", {"model": ("tiny", {"num_layers": 2})})
    assert RacingClient.calls == 2
