"""What the fault tests share: the CLI as a user runs it, in a subprocess on a store under tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipelines.schemas import REPO_ROOT


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
