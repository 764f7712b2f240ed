"""The run directory of one outcome: the files and names of docs/contract.md.

profile.csv and graph.json (every outcome), plan.json and trace.json (a planned and simulated run),
metrics.json (every outcome). Every job of one workload writes the same profile.csv and graph.json,
so their bytes are serialised once per process and copied after that. The timeline picture is
presentation and is drawn by the caller (`slackswap.simulate.timeline.write_timeline_png`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slackswap.experiment.run import RunOutcome
from slackswap.experiment.spec import RunSpec

_PROFILE_FILES: dict[str, tuple[bytes, bytes]] = {}


def write_profile_files(spec: RunSpec, outcome: RunOutcome, run_dir: Path) -> None:
    """profile.csv and graph.json of the outcome's graph."""
    from slackswap.graph_io import write_graph_json
    from slackswap.profile.report import write_profile_csv

    cached = _PROFILE_FILES.get(spec.workload_key) if spec.workload_key else None
    if cached is None:
        base = outcome.baseline
        write_profile_csv(base.graph, run_dir / "profile.csv", reference=base.analytic_graph)
        write_graph_json(base.graph, run_dir / "graph.json")
        if spec.workload_key:
            _PROFILE_FILES[spec.workload_key] = (
                (run_dir / "profile.csv").read_bytes(),
                (run_dir / "graph.json").read_bytes(),
            )
        return
    (run_dir / "profile.csv").write_bytes(cached[0])
    (run_dir / "graph.json").write_bytes(cached[1])


def write_run_files(spec: RunSpec, outcome: RunOutcome, run_dir: Path, timings: dict[str, float]) -> None:
    """Every file of the run directory but the timeline; adds `write_profile_s` and `write_results_s`
    to `timings`."""
    from slackswap.plan_io import write_plan_json
    from slackswap.simulate.trace import write_trace_json

    t0 = time.perf_counter()
    write_profile_files(spec, outcome, run_dir)
    timings["write_profile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if outcome.plan is not None:
        write_plan_json(outcome.plan, run_dir / "plan.json")
    write_json(run_dir / "metrics.json", outcome.metrics)
    if outcome.result is not None:
        write_trace_json(outcome.result, run_dir / "trace.json")
    timings["write_results_s"] = time.perf_counter() - t0


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(dict(data), indent=2, sort_keys=True) + "\n")
