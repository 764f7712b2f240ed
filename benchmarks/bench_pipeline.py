"""Where a pipeline job's time goes: imports, MLflow, each stage; and basic vs joblib launcher.

    python benchmarks/bench_pipeline.py            # the paper experiment + ~3 min on 2 cores
    python benchmarks/bench_pipeline.py --quick    # the paper experiment only

Runs everything as the user would (`python -m pipelines.run ...` in a subprocess) against a
temporary MLflow store, reads the per-job timings every job writes into run_record.json, prints the
figures and saves them to benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "pipeline.json"

IMPORT_PROBE = r"""
import json, time
t = {}
t0 = time.perf_counter(); import hydra, omegaconf, hydra.core.config_store; t["hydra_s"] = time.perf_counter() - t0
t0 = time.perf_counter(); import mlflow; t["mlflow_s"] = time.perf_counter() - t0
t0 = time.perf_counter()
import slackswap.profile, slackswap.planners.registry, slackswap.simulate
slackswap.planners.registry.available_planners()
t["slackswap_s"] = time.perf_counter() - t0
t0 = time.perf_counter(); import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot, pandas
t["matplotlib_pandas_s"] = time.perf_counter() - t0
print(json.dumps(t))
"""


def measure_imports(repeats: int = 3) -> dict[str, float]:
    samples = defaultdict(list)
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=REPO, capture_output=True, text=True, check=True)
        for key, value in json.loads(out.stdout.strip().splitlines()[-1]).items():
            samples[key].append(value)
    return {k: round(statistics.median(v), 3) for k, v in samples.items()}


def run_sweep(tmp: Path, label: str, overrides: list[str]) -> dict:
    sweep_dir = tmp / label
    flags = [o for o in overrides if o.startswith("--")]  # Hydra's argparse wants flags before overrides
    overrides = [o for o in overrides if not o.startswith("--")]
    cmd = [
        sys.executable, "-m", "pipelines.run", *flags,
        f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"tracking.artifact_location={tmp}/artifacts",
        f"hydra.sweep.dir={sweep_dir}", f"hydra.run.dir={tmp}/{label}_run", *overrides,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/run_record.json"))]
    return {"wall_s": wall_s, "records": records, "stdout": proc.stdout}


def split(records: list[dict], wall_s: float) -> dict:
    keys = sorted({k for r in records for k in r["timings_s"]})
    total = {k: sum(r["timings_s"].get(k, 0.0) for r in records) for k in keys}
    n = len(records)
    plan_by_planner = defaultdict(list)
    for r in records:
        plan_by_planner[r["planner"]].append(r["timings_s"].get("plan_s", 0.0))
    jobs_s = total.get("job_total_s", 0.0)
    return {
        "jobs": n,
        "wall_s": round(wall_s, 2),
        "per_job_mean_s": {k: round(v / n, 4) for k, v in total.items()},
        "sum_s": {k: round(v, 3) for k, v in total.items()},
        "outside_jobs_s": round(wall_s - jobs_s, 2),
        "plan_s_by_planner_mean": {p: round(statistics.mean(v), 4) for p, v in sorted(plan_by_planner.items())},
        "status_counts": dict(Counter(r["status"] for r in records)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "note": "2-core machine shared with other processes; timings are indicative (single sample).",
    }
    result["imports_s"] = measure_imports()
    print("imports (fresh interpreter, median of 3):", result["imports_s"])

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        paper = run_sweep(tmp, "paper", ["+experiment=paper"])
        result["paper_tracking_local"] = split(paper["records"], paper["wall_s"])
        result["paper_table"] = (tmp / "paper" / "paper_table.md").read_text()
        print("paper experiment (basic launcher, MLflow sqlite):", json.dumps(result["paper_tracking_local"], indent=1))
        if not args.quick:
            # MLflow on/off A/B on the same 21 jobs (milp left out: its solver time would drown the difference).
            no_milp = ["+experiment=paper", "planner=glob(*,exclude=[keep_all,milp])"]
            for tracking in ("local", "off"):
                sweep = run_sweep(tmp, f"paper_no_milp_{tracking}", [*no_milp, f"tracking={tracking}"])
                result[f"paper_without_milp_tracking_{tracking}"] = split(sweep["records"], sweep["wall_s"])
                print(f"paper without milp, tracking={tracking}: wall {sweep['wall_s']:.1f} s")
            small = ["model=gpt2_xl", "planner=slackswap,capuchin,swap_only,full_recompute", "budget.fraction=0.3,0.5"]
            launchers = {}
            for launcher in ("basic", "joblib"):
                sweep = run_sweep(tmp, f"launcher_{launcher}", ["--multirun", f"hydra/launcher={launcher}", *small])
                launchers[launcher] = split(sweep["records"], sweep["wall_s"])
                print(f"launcher {launcher}: wall {sweep['wall_s']:.1f} s for {len(sweep['records'])} jobs")
            result["launchers_8_jobs_gpt2_xl"] = launchers

    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {RESULT}")


if __name__ == "__main__":
    main()
