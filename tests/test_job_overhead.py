"""What a job costs beyond its work: each job's config composed once, with the same configs and
files as composing it for every job. Counts and contents only; the times are in benchmarks/bench_pipeline.py."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from pipelines.hydra_versions import MAIN_VERSION
from tests.test_pipeline import _run_cli


def _sweep_args(tmp_path: Path, sweep_dir: str, sweeper: str) -> list[str]:
    return [
        "--multirun",
        "model=tiny",
        "tracking=off",
        f"hydra/sweeper={sweeper}",
        f"hydra.sweep.dir={tmp_path}/{sweep_dir}",
        f"hydra.run.dir={tmp_path}/run",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
        "planner=swap_only,full_recompute",
        "budget.fraction=0.5,1.0",
        "plots=none",
    ]


def _counting_compositions(monkeypatch) -> list[list[str]]:
    calls: list[list[str]] = []
    original = ConfigLoaderImpl.load_sweep_config

    def counted(self, master_config, sweep_overrides):
        calls.append(list(sweep_overrides))
        return original(self, master_config, sweep_overrides)

    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config", counted)
    return calls


def _job_files(sweep: Path) -> dict[str, Any]:
    """Each job's Hydra config, overrides and resolved config, and its hydra node less what names the
    sweep folder or the sweeper."""
    import yaml

    names = (".hydra/config.yaml", ".hydra/overrides.yaml", "config.resolved.yaml")
    files: dict[str, Any] = {}
    for job in sorted(sweep.glob("[0-9]*")):
        files |= {f"{job.name}/{name}": (job / name).read_text() for name in names}
        hydra_node = yaml.safe_load((job / ".hydra" / "hydra.yaml").read_text())["hydra"]
        for key in ("sweeper", "sweep", "run"):
            del hydra_node[key]
        del hydra_node["runtime"]["choices"]["hydra/sweeper"], hydra_node["runtime"]["output_dir"]
        del hydra_node["overrides"]["hydra"]  # the command lines' hydra/sweeper= and hydra.sweep.dir=
        files[f"{job.name}/hydra.yaml"] = hydra_node
    return files


@pytest.mark.slow
def test_each_job_config_is_composed_once_and_is_the_same_as_the_basic_sweepers(tmp_path, monkeypatch) -> None:
    calls = _counting_compositions(monkeypatch)
    assert _run_cli(monkeypatch, _sweep_args(tmp_path, "once", "slackswap")) == 0
    # Four jobs, two planners (config groups) x two fractions (plain values): one composition per
    # planner, by the sweeper's check; the other fraction set on it; the launcher got the kept configs.
    assert sorted(o for c in calls for o in c if o.startswith("planner=")) == [
        "planner=full_recompute",
        "planner=swap_only",
    ]

    calls.clear()
    assert _run_cli(monkeypatch, _sweep_args(tmp_path, "twice", "basic")) == 0
    assert len(calls) == 8  # Hydra's basic sweeper: the check, then the launcher again

    once_files, twice_files = _job_files(tmp_path / "once"), _job_files(tmp_path / "twice")
    assert len(once_files) == 16
    # The kept and derived configs are what a fresh composition gives, down to the resolved config of
    # each job and its hydra node (overrides, override_dirname, choices).
    assert once_files == twice_files
    derived = [f for f in once_files if f.endswith("hydra.yaml") and "budget.fraction=1.0" in str(once_files[f])]
    assert len(derived) == 2 and all("budget.fraction=0.5" not in str(once_files[f]) for f in derived)


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("planner=swap_only,no_such_preset", MissingConfigException),
        ("budget.fraction=0.5,abc", ConfigCompositionException),
    ],
)
def test_a_bad_override_still_fails_before_any_job_runs(tmp_path, monkeypatch, override, error) -> None:
    """A bad preset, and a bad plain value in a job derived from another's config, fail as Hydra fails."""
    key = override.split("=")[0]
    args = [a for a in _sweep_args(tmp_path, "bad", "slackswap") if not a.startswith(f"{key}=")]
    with pytest.raises(error, match=override.split(",")[-1]):
        _run_cli(monkeypatch, [*args, override])
    assert not list((tmp_path / "bad").glob("[0-9]*/config.resolved.yaml"))  # no job started


class FakeLoader:
    def list_groups(self, parent_name: str) -> list[str]:
        return []

    def __init__(self) -> None:
        self.n = 0

    def load_sweep_config(self, master_config, sweep_overrides):
        self.n += 1
        return OmegaConf.create({"overrides": list(sweep_overrides), "n": self.n})


def test_compose_once_loader_pickles_as_the_plain_loader_and_hands_a_config_out_once() -> None:
    from hydra_plugins.slackswap_sweeper import ComposeOnceLoader

    master = OmegaConf.create({})
    loader = ComposeOnceLoader(FakeLoader())
    loader.compose_and_keep(master, ["a=1"])
    assert loader.load_sweep_config(master, ["a=1"]).n == 1  # the kept one
    assert loader.load_sweep_config(master, ["a=1"]).n == 2  # handed out once: a second request composes
    assert loader.compositions == 2
    loader.compose_and_keep(master, ["a=2"])  # same shape, but no hydra node to record it in: composed
    assert loader.compositions == 3 and loader.load_sweep_config(master, ["a=2"]).n == 3
    # A joblib/submitit worker gets the plain loader, not the kept configs.
    assert type(pickle.loads(pickle.dumps(loader))) is FakeLoader


@pytest.mark.parametrize(
    "overrides",
    [["+experiment=paper"], ["model=hf_gpt2_2l", "planner=milp"], ["budget=absolute", "simulate.allocator=caching"]],
)
def test_resolved_yaml_is_the_text_omegaconf_writes(overrides) -> None:
    from hydra import compose, initialize

    import pipelines.schemas  # noqa: F401  (root schema, repo_root resolver)
    from pipelines.job import resolve_config, resolved_yaml

    with initialize(**MAIN_VERSION, config_path="../conf"):
        resolved = resolve_config(compose("config", overrides))
    assert resolved_yaml(resolved) == OmegaConf.to_yaml(resolved)


def test_results_go_in_one_batch_and_split_only_at_mlflows_limits(mlflow_store, monkeypatch) -> None:
    """One store transaction for a job's results; MLflow's client (not ours) splits a batch over the
    store's limits, and every metric and tag lands."""
    from pipelines import tracking

    client = tracking.open_client(mlflow_store.uri)
    experiment_id = tracking.ensure_experiment(client, "batches", str(mlflow_store.artifact_root))
    batches: list[tuple[int, int]] = []
    store = client._tracking_client.store
    original = type(store).log_batch

    def counted(self, run_id, metrics=(), params=(), tags=(), **kwargs):
        batches.append((len(metrics), len(tags)))
        return original(self, run_id, metrics=metrics, params=params, tags=tags, **kwargs)

    monkeypatch.setattr(type(store), "log_batch", counted)
    small = tracking.create_run(client, experiment_id, "small", {}, None).run_id
    tracking.log_results(client, small, {"a": 1, "b": True, "none": None}, {"status": "ok"})
    assert batches == [(2, 1)]

    batches.clear()
    big = tracking.create_run(client, experiment_id, "big", {}, None).run_id
    metrics = {f"m{i}": float(i) for i in range(1500)}
    tags = {f"t{i}": str(i) for i in range(150)}
    tracking.log_results(client, big, metrics, tags)
    assert all(m <= 1000 and t <= 100 and m + t <= 1000 for m, t in batches) and len(batches) == 2
    run = client.get_run(big)
    assert run.data.metrics == metrics and {k: run.data.tags[k] for k in tags} == tags


def test_child_params_reads_every_child_of_a_parent(mlflow_store) -> None:
    from pipelines import tracking

    client = tracking.open_client(mlflow_store.uri)
    experiment_id = tracking.ensure_experiment(client, "children", str(mlflow_store.artifact_root))
    parent = tracking.create_run(client, experiment_id, "parent", {}, None).run_id
    children = [tracking.create_run(client, experiment_id, f"c{i}", {}, parent).run_id for i in range(3)]
    tracking.create_run(client, experiment_id, "not a child", {}, None)
    for i, child in enumerate(children):
        tracking.log_params(client, child, {"i": str(i)})
    assert tracking.child_params(client, parent) == {child: {"i": str(i)} for i, child in enumerate(children)}


@pytest.fixture(scope="module")
def fast_cli_run(tmp_path_factory) -> tuple[Path, Any]:
    """One `python -m pipelines.run` of a fast planner (the fast exit's path), with `-X importtime`: the
    interpreter lists every module it imports on stderr. Shared by the two tests below."""
    import subprocess

    from pipelines.schemas import REPO_ROOT

    run_dir = tmp_path_factory.mktemp("fast_cli_run") / "ok"
    cmd = [sys.executable, "-X", "importtime", "-m", "pipelines.run", "model=tiny", "tracking=off", "plots=none",
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    return run_dir, subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)


def test_a_single_run_with_a_fast_planner_does_not_import_scipys_solvers(fast_cli_run) -> None:
    """scipy.optimize and scipy.sparse (~0.4 s) are imported by milp and recompute_knapsack when they
    solve, not by the planner registry every job loads."""
    run_dir, done = fast_cli_run
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert {"pipelines.job", "slackswap.planners.registry"} <= imported  # the listing is complete
    assert sorted(n for n in ("scipy.optimize", "scipy.sparse") if n in imported) == []
    assert (run_dir / "metrics.json").is_file()


@pytest.mark.parametrize("other_thread", [False, True])
def test_exit_process_runs_atexit_flushes_and_keeps_the_code(tmp_path, other_thread) -> None:
    import subprocess
    import sys

    from pipelines.schemas import REPO_ROOT

    marker = tmp_path / "atexit_ran"
    probe = (
        "import atexit, pathlib, sys, threading, time\n"
        "from pipelines import faults\n"
        f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('yes'))\n"
        f"if {other_thread}:\n    threading.Thread(target=time.sleep, args=(0.2,)).start()\n"
        "sys.stdout.write('unflushed output')\n"
        "faults.exit_process(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 3 and out.stdout == "unflushed output" and marker.read_text() == "yes", out.stderr


@pytest.mark.slow
def test_the_cli_exit_code_and_output_survive_the_fast_exit(tmp_path, fast_cli_run) -> None:
    import subprocess
    import sys

    from pipelines.schemas import REPO_ROOT

    run_dir, ok = fast_cli_run  # `python -m pipelines.run model=tiny tracking=off plots=none`
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith(f"run dir      {run_dir}"), ok.stdout
    base = [sys.executable, "-m", "pipelines.run", "model=tiny", "tracking=off", "plots=none"]
    bad = subprocess.run([*base, "budget.fraction=7", f"hydra.run.dir={tmp_path}/bad"], cwd=REPO_ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: budget.fraction=7.0")


def test_import_paused_imports_once_with_the_collector_paused_then_freezes(tmp_path, monkeypatch):
    """The collector is off while the module body runs, back on after (also when the import fails),
    the heap is frozen after a first import only, and a disabled collector stays disabled."""
    import gc

    from pipelines.heavy_imports import import_paused

    (tmp_path / "ss_probe_module.py").write_text("import gc\nCOLLECTOR_ON_DURING_IMPORT = gc.isenabled()\n")
    (tmp_path / "ss_probe_broken.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
    assert gc.isenabled()
    module = import_paused("ss_probe_module")
    assert module.COLLECTOR_ON_DURING_IMPORT is False
    assert gc.isenabled() and freezes == [1]
    assert import_paused("ss_probe_module") is module
    assert freezes == [1]  # already imported: no pause, no second freeze
    with pytest.raises(ImportError, match="broken on purpose"):
        import_paused("ss_probe_broken")
    assert gc.isenabled()
    gc.disable()
    try:
        monkeypatch.delitem(sys.modules, "ss_probe_module")
        import_paused("ss_probe_module")
        assert not gc.isenabled()
    finally:
        gc.enable()
