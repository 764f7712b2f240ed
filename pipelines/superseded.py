"""What a sweep re-run into its own folder set aside, said in one line, and kept out of the parent run.

A re-run keeps a job's finished result of the same config and moves anything else under the same job
number (a failed or killed attempt, another grid's config) to `<sweep dir>/superseded/<job>-<n>/`
(`pipelines.job`). That move was silent, and the MLflow parent kept the set-aside runs as children:
10 children beside a 6-job summary. After the sweep, the launching process says how many folders it
set aside and where, and deletes their MLflow runs (MLflow's soft delete: they leave the parent's
list and every default view, stay in the store with the tag `superseded=true`, and
`mlflow runs restore --run-id <id>` brings one back; `mlflow gc` would remove them for good). The
parent's children are then the summary's jobs, and the set-aside files stay on disk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipelines import tracking
from pipelines.records import RECORD_FILE

SUPERSEDED_DIR = "superseded"


def folders(sweep_dir: Path) -> list[str]:
    """The folder names under `<sweep dir>/superseded/` (none when it does not exist)."""
    root = Path(sweep_dir) / SUPERSEDED_DIR
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _run_id(folder: Path) -> str | None:
    try:
        run_id = json.loads((folder / RECORD_FILE).read_text()).get("mlflow_run_id")
    except (OSError, ValueError, AttributeError):
        return None  # no record, or one this version cannot read: no run to find
    return run_id if isinstance(run_id, str) and run_id else None


def delete_children(client, parent: Mapping[str, Any], sweep_dir: Path, names: Sequence[str]) -> int:
    """Soft-delete the MLflow runs of the set-aside folders `names` that are children of `parent`,
    tagged `superseded=true` first; returns how many."""
    deleted = 0
    for name in names:
        run_id = _run_id(Path(sweep_dir) / SUPERSEDED_DIR / name)
        if run_id is None:
            continue
        try:
            run = client.get_run(run_id)
            if run.data.tags.get(tracking.PARENT_RUN_TAG) != parent["run_id"] or run.info.lifecycle_stage != "active":
                continue
            tracking.log_tags(client, run_id, {"superseded": "true",
                                               "superseded_reason": f"set aside in {SUPERSEDED_DIR}/{name}"})
            client.delete_run(run_id)
            deleted += 1
        except Exception:  # noqa: S112 (best effort: a run of another store, or already gone)
            continue
    return deleted


def line(sweep_dir: Path, names: Sequence[str], deleted: int | None) -> str:
    """`2 earlier job folder(s) set aside in <dir> (0-1, 1-1): ...; their 2 MLflow run(s) deleted ...`"""
    shown = ", ".join(names[:8]) + (f", ... (+{len(names) - 8})" if len(names) > 8 else "")
    text = (f"{len(names)} earlier job folder(s) set aside in {Path(sweep_dir) / SUPERSEDED_DIR} ({shown}): another "
            "config, or a failed or killed attempt, under the same job number; not in the summary")
    if deleted:
        text += (f"; their {deleted} MLflow run(s) deleted from the parent (tag superseded=true; "
                 "`mlflow runs restore --run-id <id>` brings one back)")
    return text
