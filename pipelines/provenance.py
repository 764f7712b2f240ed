"""What a run ran with: the versions of Python and the libraries, and the repository's commit.

Recorded by every job in `run_record.json` (`versions`) and as MLflow tags (`version.<name>`), beside
MLflow's own source tags. The commit counts as dirty when a tracked file is modified or when an
untracked file lies where the code and the presets are (`conf/`, `slackswap/`, `pipelines/`,
`hydra_plugins/`): a new preset copied from a shipped one (`cp conf/model/gpt2_xl.yaml
conf/model/my.yaml`) changes what the runs mean without touching a tracked file.
"""

from __future__ import annotations

import subprocess
from functools import cache

from pipelines.schemas import REPO_ROOT
from slackswap.versions import package_versions

#: The distributions whose versions every record carries (importlib.metadata names).
DISTRIBUTIONS = ("numpy", "scipy", "pandas", "torch", "transformers", "mlflow", "hydra-core", "omegaconf")
#: Untracked files here make the tree dirty (code and presets a run reads).
WATCHED_DIRS = ("conf/", "slackswap/", "pipelines/", "hydra_plugins/")


@cache
def git_commit() -> str:
    """HEAD of the repository the code runs from, with `-dirty` when tracked files are modified or
    untracked files lie in `WATCHED_DIRS`; `unknown (...)` outside a git checkout."""
    try:
        sha = _git("rev-parse", "HEAD").strip()
        status = _git("status", "--porcelain", "--untracked-files=all")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"
    return f"{sha}-dirty" if is_dirty(status) else sha


def is_dirty(porcelain: str) -> bool:
    """From `git status --porcelain` output: a tracked change anywhere, or an untracked watched file."""
    for line in porcelain.splitlines():
        if not line.strip():
            continue
        if not line.startswith("??"):
            return True
        path = line[3:].strip().strip('"')
        if path.startswith(WATCHED_DIRS):
            return True
    return False


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
    ).stdout


@cache
def versions() -> dict[str, str]:
    """{"python": ..., "slackswap": ..., "numpy": ..., ..., "slackswap_commit": sha[-dirty]}."""
    return package_versions(DISTRIBUTIONS) | {"slackswap_commit": git_commit()}


def version_tags() -> dict[str, str]:
    """The versions as MLflow tags: `version.python`, `version.torch`, ... (`version.slackswap_commit`)."""
    return {f"version.{name}": value for name, value in versions().items()}
