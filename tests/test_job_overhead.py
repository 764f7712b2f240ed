"""What a job costs beyond its work (issue 12, "cheap jobs"): each job's config composed once, the
same configs and files as before. Counts and contents only; the times are in benchmarks/bench_pipeline.py."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

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


def _job_files(sweep: Path) -> dict[str, str]:
    """Each job's Hydra config, overrides and resolved config (no paths of the sweep folder in them)."""
    names = (".hydra/config.yaml", ".hydra/overrides.yaml", "config.resolved.yaml")
    return {f"{job.name}/{name}": (job / name).read_text() for job in sorted(sweep.glob("[0-9]*")) for name in names}


def test_each_job_config_is_composed_once_and_is_the_same_as_the_basic_sweepers(tmp_path, monkeypatch) -> None:
    calls = _counting_compositions(monkeypatch)
    assert _run_cli(monkeypatch, _sweep_args(tmp_path, "once", "slackswap")) == 0
    once = list(calls)
    # Four jobs, each composed by the sweeper's check only: the launcher got the kept configs.
    assert len(once) == 4 and len({tuple(c) for c in once}) == 4

    calls.clear()
    assert _run_cli(monkeypatch, _sweep_args(tmp_path, "twice", "basic")) == 0
    assert len(calls) == 8  # Hydra's basic sweeper: the check, then the launcher again

    once_files, twice_files = _job_files(tmp_path / "once"), _job_files(tmp_path / "twice")
    assert len(once_files) == 12
    # The kept configs are what a fresh composition gives, down to the resolved config of each job
    # (the one difference allowed: the sweeper's name in the job's hydra choices is not in these files).
    assert once_files == twice_files


def test_a_bad_override_still_fails_before_any_job_runs(tmp_path, monkeypatch) -> None:
    args = [a for a in _sweep_args(tmp_path, "bad", "slackswap") if not a.startswith("planner=")]
    with pytest.raises(MissingConfigException, match="no_such_preset"):
        _run_cli(monkeypatch, [*args, "planner=swap_only,no_such_preset"])
    assert not list((tmp_path / "bad").glob("[0-9]*/config.resolved.yaml"))  # no job started


class FakeLoader:
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
    loader.compose_and_keep(master, ["a=2"])
    # A joblib/submitit worker gets the plain loader, not the kept configs.
    assert type(pickle.loads(pickle.dumps(loader))) is FakeLoader
