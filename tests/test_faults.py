"""Faults of every entry point end in one line, an exit code and nothing RUNNING (docs/pipeline.md,
"Faults"): config mistakes Hydra itself reports, a full disk, a read-only folder, an interrupted
`pipelines.train`, resumed sweeps, summaries of what a sweep has. Each test asserts the MLflow status,
the files on disk and the lines printed."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.schemas import REPO_ROOT
from tests.cli_support import run_cli_in_process
from tests.extras import require_torch_extra


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return env | {"PYTHONPATH": str(REPO_ROOT)} | extra


def _store_args(store) -> list[str]:
    return [
        f"tracking.uri={store.uri}",
        f"tracking.artifact_location={store.artifact_root}",
        "tracking.experiment=test",
        "hydra/hydra_logging=disabled",
    ]


def _runs(db: Path) -> list[dict[str, str | None]]:
    """Every run's status, parent, status tag, reason tag and source name (sqlite3: no MLflow import)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        rows = conn.execute(
            "SELECT r.status, p.value, s.value, w.value, n.value FROM runs r "
            "LEFT JOIN tags p ON p.run_uuid = r.run_uuid AND p.key = 'mlflow.parentRunId' "
            "LEFT JOIN tags s ON s.run_uuid = r.run_uuid AND s.key = 'status' "
            "LEFT JOIN tags w ON w.run_uuid = r.run_uuid AND w.key = 'reason' "
            "LEFT JOIN tags n ON n.run_uuid = r.run_uuid AND n.key = 'mlflow.source.name'"
        ).fetchall()
    return [dict(zip(("status", "parent", "tag", "reason", "source"), row, strict=True)) for row in rows]


def _errors(err: str) -> list[str]:
    """stderr without MLflow's own INFO lines (schema creation)."""
    return [line for line in err.splitlines() if line.strip() and " INFO mlflow" not in line]


def _in_process(monkeypatch, tmp_path: Path, *args: str, module: str = "pipelines.run") -> int:
    """The CLI in this process, as `python -m` from `tmp_path`; returns its exit code."""
    monkeypatch.chdir(tmp_path)
    return run_cli_in_process(monkeypatch, module, args)


# ------------------------------------------------------------------ config mistakes: one line, exit 2


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["model=gpt5"], "error: model=gpt5: no such preset (conf/model/gpt5.yaml); known: bert_large,"),
        (["budget.fracton=0.3"],
         "error: budget.fracton: no such key in budget (Key 'fracton' not in 'BudgetSchema'"),
        (["model.num_layers=three"], "error: model.num_layers: Value 'three' of type 'str' could not be converted"),
        (["-m", "model=tiny,gpt5"], "error: model=gpt5: no such preset"),
        (["-m", "model=tiny", "model.num_layer=2,3"], "error: model.num_layer: no such key in model (Key 'num_layer'"),
        (["model=tiny_torch", "model.attention=flash"],
         "error: model.attention='flash': ignored by a traced preset: its graph follows model.torch.attention"),
    ],
)  # fmt: skip
def test_config_mistakes_are_one_line_exit_2_before_anything_is_recorded(
    tmp_path, mlflow_store, monkeypatch, capsys, args, line
) -> None:
    sweep = tmp_path / "sweep"
    code = _in_process(
        monkeypatch, tmp_path, *args, *_store_args(mlflow_store), f"hydra.run.dir={tmp_path}/run",
        f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    err = _errors(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err
    # omegaconf 2.4 adds "Did you mean: ...?" inside the brackets; the known keys follow on either.
    assert "no such key" not in line or "); known: " in err[0], err
    assert "+" not in err[0].split(":", 2)[1]  # no Hydra hint `+key=...` (it fails again on the schema)
    # Nothing recorded: no MLflow run (in a sweep: no empty parent), no sweep folder.
    assert _runs(mlflow_store.db_path) == []
    assert not sweep.exists()


def test_a_value_error_in_a_sweep_fails_its_job_and_the_sweep_exits_1(tmp_path, monkeypatch, capsys) -> None:
    """What docs/pipeline.md says (it said both this and "one line, exit 2"): a value the config composes
    with but the library refuses is checked when its job runs; the other jobs run."""
    sweep = tmp_path / "sweep"
    code = _in_process(monkeypatch, tmp_path, "-m", "model=tiny", "planner=keep_all", "budget.fraction=1.5,1.0",
                       "tracking=off", "plots=none", f"hydra.sweep.dir={sweep}", "hydra/hydra_logging=disabled",
                       "hydra/job_logging=disabled")  # fmt: skip
    captured = capsys.readouterr()
    assert code == 1 and _errors(captured.err) == [f"1 of 2 jobs failed (see summary.md in {sweep})"], captured.err
    records = {r["budget_fraction"]: r for r in (json.loads(p.read_text()) for p in sweep.glob("*/run_record.json"))}
    assert records[1.0]["status"] == "ok" and records[1.5]["status"] == "failed"
    assert records[1.5]["failure_reason"].startswith("ConfigError: budget.fraction=1.5: must be in (0, 1]")


@pytest.mark.parametrize(
    ("edit", "line"),
    [
        (("num_layers:", "num_layer:"),
         "error: model.num_layer (in preset model/typo): no such key in model (Key 'num_layer' not in 'ModelSchema'"),
        (("num_layers: 2", "num_layers: two"),
         "error: model.num_layers (in preset model/typo): Value 'two' of type 'str' could not be converted"),
    ],
)  # fmt: skip
def test_a_mistake_inside_a_preset_file_names_the_key_and_the_preset(tmp_path, monkeypatch, capsys, edit, line) -> None:
    """The README's "add a model" path: a new conf/model/<name>.yaml with a typo or a wrong type. Hydra
    raises its composition error without `from`, and its first line ends at a colon; the key and
    omegaconf's reason must still be on the one line."""
    presets = tmp_path / "presets" / "model"
    presets.mkdir(parents=True)
    (presets / "typo.yaml").write_text((REPO_ROOT / "conf/model/tiny.yaml").read_text().replace(*edit))
    code = _in_process(
        monkeypatch, tmp_path, "model=typo", "tracking=off", f"hydra.run.dir={tmp_path}/run",
        f"hydra.searchpath=[file://{tmp_path}/presets]",
    )  # fmt: skip
    err = _errors(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err
    # omegaconf 2.4 adds "Did you mean: ...?" inside the brackets; the known keys follow on either.
    assert "no such key" not in line or "); known: " in err[0], err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------- full disk, read-only folder (tmpfs)


def _unshare_works(tmp_path: Path) -> str | None:
    """None when this process may mount a tmpfs in a private mount namespace, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"], capture_output=True, text=True
    )
    return None if done.returncode == 0 else f"unshare -m + mount refused here: {done.stderr.strip()[:200]}"


def _on_tmpfs(folder: Path, options: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m pipelines.run args` with `folder` on a tmpfs of its own (`-o options`)."""
    folder.mkdir(exist_ok=True)
    script = f'mount -t tmpfs -o {options} tmpfs "{folder}" && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", sys.executable, "-m", "pipelines.run", *args],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_a_full_disk_or_read_only_folder_ends_runs_failed_with_one_line(tmp_path, mlflow_store) -> None:
    why = _unshare_works(tmp_path)
    if why is not None:
        pytest.skip(why)
    store = _store_args(mlflow_store)
    disk = tmp_path / "disk"

    # A single run: bert_large's graph.json (~290 KB) does not fit in 300 KiB.
    done = _on_tmpfs(disk, "size=300k", "model=bert_large", *store, f"hydra.run.dir={disk}/one", cwd=tmp_path)
    err = _errors(done.stderr)
    assert done.returncode == 1 and len(err) == 1, done.stderr
    assert err[0].startswith("error: run failed: OSError: No space left on device: ") and "graph.json" in err[0]
    runs = _runs(mlflow_store.db_path)
    assert [(r["status"], r["tag"]) for r in runs] == [("FAILED", "failed")]
    assert "No space left on device" in runs[0]["reason"] and "graph.json" in runs[0]["reason"]

    # A sweep on the full disk: every job ends, the parent ends FAILED, the summary says what it has.
    done = _on_tmpfs(
        disk, "size=300k", "-m", "model=bert_large,tiny", "planner=slackswap,capuchin", *store,
        f"hydra.sweep.dir={disk}/sweep", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "# Sweep summary" in done.stdout
    assert "4 jobs:" in done.stdout or "of 4 jobs:" in done.stdout
    runs = _runs(mlflow_store.db_path)
    assert not [r for r in runs if r["status"] == "RUNNING"], runs
    sweep_parent = [r for r in runs if r["parent"] is None][1:]  # the first parentless run is the single run
    assert [(p["status"], p["tag"]) for p in sweep_parent] == [("FAILED", "failed")]
    children = [r for r in runs if r["parent"]]
    assert len(children) == 4 and all(c["status"] in ("FAILED", "FINISHED") for c in children), runs
    assert any("No space left on device" in (c["reason"] or "") for c in children)
    for line in _errors(done.stderr):  # each printed problem names its file
        assert line.startswith(("error: ", "3 of 4", "4 of 4", "2 of 4", "1 of 4")), line

    # A read-only output folder: one line naming the folder, nothing recorded.
    before = len(_runs(mlflow_store.db_path))
    ro = tmp_path / "ro"
    done = _on_tmpfs(ro, "ro", "model=tiny", *store, f"hydra.run.dir={ro}/run", cwd=tmp_path)
    err = _errors(done.stderr)
    assert done.returncode == 1 and err == [f"error: Read-only file system: {ro}/run (EROFS)"], done.stderr
    assert len(_runs(mlflow_store.db_path)) == before


@pytest.mark.slow
@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_read_only_store_is_one_line_naming_it_before_any_run(tmp_path, mlflow_store, what) -> None:
    """A read-only `mlflow.db` (or its folder): one line with the path and "read-only", exit 1 as other
    store faults, no Python traceback (it was 92 lines ending in SQLAlchemy's autoflush message).
    Read-only by a private read-only bind mount: file modes do not stop root, a mount does."""
    why = _unshare_works(tmp_path)
    if why is not None:
        pytest.skip(why)
    db = mlflow_store.db_path
    target = db if what == "file" else db.parent
    before = _runs(db)
    single = ["model=tiny", f"hydra.run.dir={tmp_path}/run"]
    sweep = ["-m", "model=tiny", f"hydra.sweep.dir={tmp_path}/sweep"]
    for args in (single, sweep):
        script = f'mount --bind "{target}" "{target}" && mount -o remount,ro,bind "{target}" && exec "$@"'
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", script, "sh", sys.executable, "-m", "pipelines.run", *args,
             *_store_args(mlflow_store)],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        err = _errors(done.stderr)
        assert done.returncode == 1 and len(err) == 1, done.stderr
        assert err[0].startswith(f"error: tracking store {db} is ") and "read-only" in err[0], err
        assert "Traceback" not in done.stderr
    assert _runs(db) == before


@pytest.mark.parametrize(("store", "line"), [("garbage", "is not an MLflow SQLite database"),
                                             ("server", "no MLflow server answers")])
def test_a_refused_store_is_refused_before_mlflow_is_imported(tmp_path, monkeypatch, store, line) -> None:
    """The store's checks come before MLflow's import (about 1 s of CPU a process): a refusal costs
    its one line, not the import. Port 9 (discard) on 127.0.0.1 has no server."""
    from pipelines import heavy_imports, tracking

    def no_import(name: str) -> None:
        raise AssertionError(f"{name} imported before the store was checked")

    monkeypatch.setattr(heavy_imports, "import_paused", no_import)
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"this is not a database" * 100)
    uri = f"sqlite:///{db}" if store == "garbage" else "http://127.0.0.1:9"
    with pytest.raises(tracking.TrackingUnavailable, match=line):
        tracking.open_client(uri)


# ------------------------------------------------------------------------------- pipelines.train


@pytest.mark.slow
def test_sigterm_ends_a_training_run_killed_with_one_line(tmp_path, mlflow_store) -> None:
    require_torch_extra()
    import signal
    import time

    args = ["model=tiny_torch", "train.steps=200", *_store_args(mlflow_store), f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.train", *args], cwd=tmp_path, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if mlflow_store.db_path.is_file() and any(r["status"] == "RUNNING" for r in _safe_runs(mlflow_store.db_path)):
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    line = f"interrupted by SIGTERM; 1 MLflow run(s) marked KILLED; output in {tmp_path}/run"
    assert proc.returncode == 143 and _errors(err) == [line], err
    [run] = _runs(mlflow_store.db_path)
    assert (run["status"], run["tag"], run["source"]) == ("KILLED", "killed", "pipelines/train.py")


def _safe_runs(db: Path) -> list[dict[str, str | None]]:
    try:
        return _runs(db)
    except sqlite3.Error:  # the schema is being created
        return []


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("train.device=gpu", "error: train.device='gpu': unknown device; known: ('cpu', 'cuda')"),
        ("budget.fraction=1.5", "error: budget.fraction=1.5: must be in (0, 1]"),
    ],
)
def test_train_bad_values_are_one_line_exit_2(tmp_path, mlflow_store, monkeypatch, capsys, override, line) -> None:
    args = ["model=tiny_torch", override, *_store_args(mlflow_store), f"hydra.run.dir={tmp_path}/run"]
    code = _in_process(monkeypatch, tmp_path, *args, module="pipelines.train")
    err = _errors(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err
    assert _runs(mlflow_store.db_path) == []


@pytest.mark.parametrize("module", ["pipelines.run", "pipelines.train"])
@pytest.mark.parametrize(
    ("hook", "line"),
    [
        ("my_models.mlp:build", "error: model.torch.hook='my_models.mlp:build': cannot be imported "
         "(ModuleNotFoundError: No module named 'my_models'); the part before ':' must be a module importable "
         "where you run (put its folder on PYTHONPATH)"),
        ("slackswap.profile.torch.tiny:no_such_function", "error: model.torch.hook='slackswap.profile.torch.tiny:"
         "no_such_function': module 'slackswap.profile.torch.tiny' ("),
    ],
)  # fmt: skip
def test_a_model_hook_that_cannot_be_imported_is_a_config_error(
    tmp_path, mlflow_store, monkeypatch, capsys, module, hook, line
) -> None:
    """A user's hook not on the import path is a config mistake (exit 2, one line saying what to check),
    found before any MLflow run, not a failed run (exit 1) found by the profile stage."""
    if hook.startswith("slackswap.profile.torch"):
        require_torch_extra()  # that module imports torch
    code = _in_process(
        monkeypatch, tmp_path, "model=tiny_torch", "model.torch.builder=hook", f"model.torch.hook={hook}",
        *_store_args(mlflow_store), f"hydra.run.dir={tmp_path}/run", module=module,
    )  # fmt: skip
    err = _errors(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err
    assert _runs(mlflow_store.db_path) == []


def test_verify_torch_on_a_cpu_only_torch_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    torch = require_torch_extra()
    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    code = _in_process(
        monkeypatch, tmp_path, "model=tiny_torch", "+device=cuda", f"hydra.run.dir={tmp_path}/run",
        module="pipelines.verify_torch",
    )  # fmt: skip
    err = _errors(capsys.readouterr().err)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: device='cuda': torch {torch.__version__} (") and "use +device=cpu" in err[0]
    assert not (tmp_path / "run" / "verify_torch.json").exists()


# ------------------------------------------------------------------ summaries, records, corrupt files


def _fake_sweep(folder: Path, jobs: dict[str, tuple[str, list[str]]]) -> None:
    """Job folders with a record (status) and Hydra's overrides.yaml, as a sweep leaves them."""
    from pipelines.records import RunRecord, RunStatus

    (folder / "sweep_progress.json").parent.mkdir(parents=True, exist_ok=True)
    for job, (status, overrides) in jobs.items():
        (folder / job / ".hydra").mkdir(parents=True)
        (folder / job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        mbs = next(o.split("=")[1] for o in overrides if o.startswith("model.micro_batch_size"))
        metrics = {"keep_all_peak_bytes": 100 * int(mbs), "budget_bytes": 50 * int(mbs), "throughput_ratio": 0.9}
        RunRecord(
            run_name=job, choices={"model": "tiny"}, model="tiny", hardware="a100", planner="slackswap",
            planner_name="slackswap", budget_fraction=0.5, budget_bytes_requested=None, run_dir=str(folder / job),
            status=RunStatus(status), metrics=metrics,
        ).write(folder / job)  # fmt: skip


def test_summaries_carry_a_column_per_swept_key_and_say_what_is_missing(tmp_path) -> None:
    from pipelines import aggregate

    _fake_sweep(tmp_path, {
        str(i): ("ok", ["model=tiny", f"model.micro_batch_size={mbs}", "budget.fraction=0.5", "planner=slackswap"])
        for i, mbs in enumerate((1, 2, 4))
    })  # fmt: skip
    (tmp_path / "sweep_progress.json").write_text(json.dumps({"total": 5, "started_unix_s": 0}))
    result = aggregate.aggregate_sweep(tmp_path, {}, plots=False)
    assert list(result.table["model.micro_batch_size"]) == ["1", "2", "4"]
    head, table = result.summary_md.split("\n\n")[1:3]
    assert head == "3 of 5 jobs: 3 ok; 2 missing (no run_record.json)" and result.missing == 2
    assert table.splitlines()[0].startswith("| model | hardware | budget | planner | model.micro_batch_size | status |")
    assert "model.micro_batch_size" in (tmp_path / "summary.csv").read_text().splitlines()[0]
    # Keys that do not vary, and those the table shows anyway, get no column.
    assert "budget.fraction" not in result.table.columns and "planner.name" not in result.table.columns


def test_a_corrupt_graph_or_plan_file_is_one_error_naming_it(tmp_path) -> None:
    from slackswap.errors import FileFormatError
    from slackswap.graph_io import read_graph_json
    from slackswap.plan_io import read_plan_json

    for name, read in (("graph.json", read_graph_json), ("plan.json", read_plan_json)):
        path = tmp_path / name
        path.write_text('{"schema": "slackswap.graph", "ops": [')
        with pytest.raises(FileFormatError) as info:
            read(path)
        assert str(info.value).startswith(f"{path}: not a valid {name} (") and "\n" not in str(info.value)


def test_every_planner_has_its_own_colour_and_marker_and_milp_shows_over_slackswap() -> None:
    from pipelines.sweep_plots import planner_styles

    presets = sorted(p.stem for p in (REPO_ROOT / "conf" / "planner").glob("*.yaml"))
    styles = planner_styles([*presets, "my_planner", "capuchin[swap_only]"])
    looks = [(s.color, s.marker) for s in styles.values()]
    assert len(set(c for c, _ in looks)) == len(looks) and len(set(m for _, m in looks)) == len(looks)
    milp, slackswap = styles["milp"], styles["slackswap"]
    assert milp.linestyle != "-" and milp.zorder > slackswap.zorder and milp.hatch
    # A planner keeps its look from plot to plot, whoever else is drawn.
    assert planner_styles(["capuchin", "swap_only"])["capuchin"] == styles["capuchin"]


def test_untracked_presets_make_the_tree_dirty() -> None:
    from pipelines.provenance import is_dirty

    assert not is_dirty("")
    assert not is_dirty("?? outputs/2026-01-01/run/x.json\n?? notes.txt\n")
    assert is_dirty("?? conf/model/my.yaml\n")  # cp conf/model/gpt2_xl.yaml conf/model/my.yaml
    assert is_dirty(" M README.md\n")


def test_every_run_records_the_versions_it_ran_with(tmp_path, mlflow_store, monkeypatch, capsys) -> None:
    from importlib import metadata

    args = ["model=tiny", "planner=keep_all", "budget.fraction=1.0", "plots=none", *_store_args(mlflow_store),
            f"hydra.run.dir={tmp_path}/run"]  # fmt: skip
    assert _in_process(monkeypatch, tmp_path, *args) == 0
    versions = json.loads((tmp_path / "run" / "run_record.json").read_text())["versions"]
    expected = {"python", "slackswap", "numpy", "scipy", "pandas", "torch", "transformers", "mlflow", "hydra-core"}
    assert expected <= set(versions) and versions["mlflow"] == metadata.version("mlflow")
    assert versions["slackswap_commit"] and versions["numpy"] == metadata.version("numpy")
    client = mlflow_store.client()
    [run] = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    tags = run.data.tags
    assert {f"version.{k}": v for k, v in versions.items()}.items() <= tags.items()
    assert tags["mlflow.source.name"] == "pipelines/run.py" and not tags["mlflow.source.name"].startswith("/")
    if not versions["slackswap_commit"].startswith("unknown"):
        assert tags["mlflow.source.git.dirty"] == str(versions["slackswap_commit"].endswith("-dirty")).lower()


@pytest.mark.parametrize("module", ["pipelines.advise", "pipelines.profile"])
def test_other_entry_points_report_config_mistakes_the_same_way(tmp_path, monkeypatch, capsys, module) -> None:
    code = _in_process(monkeypatch, tmp_path, "model=gpt5", "tracking=off", f"hydra.run.dir={tmp_path}/run",
                       module=module)  # fmt: skip
    err = _errors(capsys.readouterr().err)
    assert code == 2 and err == [err[0]] and err[0].startswith("error: model=gpt5: no such preset"), err
    assert not (tmp_path / "run").exists()
