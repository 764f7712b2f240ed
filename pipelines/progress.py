"""i/N progress with elapsed time for sweeps.

Hydra's basic sweeper knows how many jobs a sweep has only inside `sweep()`, and it composes every
job's config before the first one runs (about 20 s of silence for 216 jobs). `ProgressSweeper`
(`hydra_plugins/slackswap_sweeper`, where Hydra requires plugins to live; `hydra/sweeper=slackswap`)
is the basic sweeper plus two things: it says how many jobs there are before that check, and it writes the
count and the start time to `<sweep dir>/sweep_progress.json`, which every job (in this process or in a
launcher's worker) reads to print `[i/N 12.3 s]` in front of its one-line result. i counts the lines of
`<sweep dir>/sweep_done.txt`, to which each job of this sweep run appends its name as it ends (a job
kept from an earlier run of the folder too), so a re-run counts 1, 2, 3, ... again rather than every
record already in the folder.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipelines.console import format_one_line

PROGRESS_FILE = "sweep_progress.json"
DONE_FILE = "sweep_done.txt"


def read_progress(sweep_dir: Path) -> dict[str, Any] | None:
    path = sweep_dir / PROGRESS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def job_line(ctx: Any, record: Mapping[str, Any], reused: bool = False) -> str:
    """`[i/N 12.3 s] [status] name: throughput retained ...`; i counts the jobs of the sweep that have
    finished (with parallel workers it is the order of completion, not the job number)."""
    line = format_one_line(record) + ("  (kept from an earlier run of this sweep folder)" if reused else "")
    try:
        progress = read_progress(ctx.sweep_dir) if ctx.sweep_dir is not None else None
        if progress is None:
            return line
        done = mark_done(ctx.sweep_dir, ctx.run_dir.name)
    except (OSError, ValueError):  # a full disk: the result line matters more than the count
        return line
    elapsed_s = time.time() - progress["started_unix_s"]
    return f"[{done}/{progress['total']} {elapsed_s:6.1f} s] {line}"


def mark_done(sweep_dir: Path, job: str) -> int:
    """Append `job` to the sweep's done list (one short O_APPEND write, atomic between workers);
    returns how many jobs of this sweep run have ended."""
    path = sweep_dir / DONE_FILE
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(job + "\n")
    with open(path, encoding="utf-8") as handle:
        return sum(1 for _ in handle)
