"""tools/replay_allocator_gpu.py on its CPU path: the model side and the dry run (no GPU in CI)."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipelines import schemas
from pipelines.hydra_versions import MAIN_VERSION
from slackswap.experiment import RunSpec, run_one, write_run_files
from tests.extras import require_torch_extra
from tools import replay_allocator_gpu as script


def test_dry_run_from_a_run_dir_reproduces_the_runs_reserved_peak(tmp_path, capsys):
    with initialize_config_dir(config_dir=str(schemas.REPO_ROOT / "conf"), **MAIN_VERSION):
        cfg = compose("config", overrides=["model=tiny", "simulate.allocator=caching", "tracking=off"])
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    (tmp_path / "config.resolved.yaml").write_text(OmegaConf.to_yaml(resolved))
    spec = RunSpec.from_dict(resolved)
    outcome = run_one(spec)
    write_run_files(spec, outcome, tmp_path, {})
    metrics = outcome.metrics
    out = tmp_path / "replay.json"
    assert script.main(["--run-dir", str(tmp_path), "--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model_peak_reserved_bytes"] == metrics["peak_reserved_bytes"]
    assert report["peak_activation_bytes"] == metrics["peak_activation_bytes"]
    assert report["calls"] > 0 and report["gpu"].startswith("dry run")
    assert json.loads(capsys.readouterr().out) == report


def test_model_trajectory_never_reserves_less_than_it_allocates():
    ops = [script.MemoryOp(0.0, True, 0, "a", 3 << 20), script.MemoryOp(1.0, True, 1, "b", 100),
           script.MemoryOp(2.0, False, 0, "a", 3 << 20), script.MemoryOp(3.0, True, 2, "c", 2 << 20)]
    # 3 MiB: 20 MiB segment; 100 B: 512 in a 2 MiB small segment; the 2 MiB request reuses the freed
    # 3 MiB block's place in the 20 MiB segment (rest 17 MiB merged back: 20 MiB free, best fit, split).
    assert script.model_trajectory(ops) == [
        (20 << 20, 3 << 20),
        (22 << 20, (3 << 20) + 512),
        (22 << 20, 512),
        (22 << 20, (2 << 20) + 512),
    ]


def test_without_a_cuda_device_only_the_dry_run_runs(capsys):
    torch = require_torch_extra("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU path runs instead")
    assert script.main(["model=tiny"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
