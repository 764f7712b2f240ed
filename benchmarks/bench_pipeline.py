"""Where a pipeline job's time goes: imports, MLflow, each stage; and basic vs joblib launcher.

    python benchmarks/bench_pipeline.py            # job costs, the paper experiment, A/B of MLflow and launchers
    python benchmarks/bench_pipeline.py --quick    # imports and job costs only (single run, budget_curves)

Runs everything as the user would (`python -m pipelines.run ...` in a subprocess) against a
temporary MLflow store, reads the per-job timings every job writes into run_record.json, prints the
figures and saves them to benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import machine  # noqa: E402

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


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(cmd: list[str], label: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `cmd` from the repository root: (the finished process, wall s, CPU s of the child)."""
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall_s, cpu_s = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc, wall_s, cpu_s


def run_single(tmp: Path, label: str, overrides: list[str] = ()) -> dict:
    """One `python -m pipelines.run` (not a sweep) against the store in `tmp`: wall and CPU seconds."""
    cmd = [
        sys.executable, "-m", "pipelines.run",
        f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"tracking.artifact_location={tmp}/artifacts",
        f"hydra.run.dir={tmp}/{label}", *overrides,
    ]  # fmt: skip
    _, wall_s, cpu_s = _timed(cmd, label)
    return {"wall_s": round(wall_s, 3), "cpu_s": round(cpu_s, 3)}


def job_costs(tmp: Path) -> dict:
    """The job-cost figures of record: a single run on an existing database, budget_curves' wall time, and the
    marginal cost of a sweep job = (budget_curves - the same experiment narrowed to one job) / (jobs - 1),
    in wall and in CPU seconds (CPU: what the run itself costs, whatever else loads the machine)."""
    run_single(tmp, "create_store")  # the database exists from here on
    single = run_single(tmp, "single_gpt2_xl", ["model=gpt2_xl"])
    print(f"single run (gpt2_xl, slackswap, existing database): {single['wall_s']:.2f} s wall, "
          f"{single['cpu_s']:.2f} s CPU")
    one = run_sweep(tmp, "budget_curves_one_job",
                    ["+experiment=budget_curves", "model=gpt2_xl", "planner=slackswap", "budget.fraction=0.5"])
    full = run_sweep(tmp, "budget_curves", ["+experiment=budget_curves"])
    n = len(full["records"])
    milp = [r for r in full["records"] if r["planner_name"] == "milp"]
    milp_job_s = sum(r["timings_s"].get("job_total_s", 0.0) for r in milp)
    out = {
        "single_run": single,
        "budget_curves": {"jobs": n, "wall_s": round(full["wall_s"], 2), "cpu_s": round(full["cpu_s"], 2),
                          **split(full["records"], full["wall_s"])},
        "one_job_sweep": {"wall_s": round(one["wall_s"], 2), "cpu_s": round(one["cpu_s"], 2)},
        "marginal_job_wall_s": round((full["wall_s"] - one["wall_s"]) / (n - 1), 4),
        "marginal_job_cpu_s": round((full["cpu_s"] - one["cpu_s"]) / (n - 1), 4),
        # Without milp's own job time (its solver, ~1-2 s a job): the marginal cost of the other jobs.
        "marginal_job_wall_s_without_milp_work": round(
            (full["wall_s"] - one["wall_s"] - milp_job_s) / (n - 1 - len(milp)), 4) if milp else None,
        "milp_jobs": len(milp),
        "milp_job_total_s": round(milp_job_s, 2),
    }
    print(f"budget_curves: {n} jobs in {full['wall_s']:.1f} s wall ({full['cpu_s']:.1f} s CPU); one-job sweep "
          f"{one['wall_s']:.1f} s; marginal per job {out['marginal_job_wall_s']:.3f} s wall, "
          f"{out['marginal_job_cpu_s']:.3f} s CPU; without milp's work "
          f"{out['marginal_job_wall_s_without_milp_work']} s")
    return out


def run_sweep(tmp: Path, label: str, overrides: list[str]) -> dict:
    sweep_dir = tmp / label
    flags = [o for o in overrides if o.startswith("--")]  # Hydra's argparse wants flags before overrides
    overrides = [o for o in overrides if not o.startswith("--")]
    cmd = [
        sys.executable, "-m", "pipelines.run", *flags,
        f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"tracking.artifact_location={tmp}/artifacts",
        f"hydra.sweep.dir={sweep_dir}", f"hydra.run.dir={tmp}/{label}_run", *overrides,
    ]  # fmt: skip
    proc, wall_s, cpu_s = _timed(cmd, label)
    records = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/run_record.json"))]
    return {"wall_s": wall_s, "cpu_s": cpu_s, "records": records, "stdout": proc.stdout}


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


def run(quick: bool = False) -> dict:
    result: dict = {
        "machine_at_start": machine(),
        "note": "2-core machine shared with other processes: wall times carry the load (see the load "
        "average); CPU times (children's user + system) are what the runs themselves cost.",
    }
    print("load average at start (1, 5, 15 min):", result["machine_at_start"].get("load_average_1_5_15"))
    result["imports_s"] = measure_imports(1 if quick else 3)
    print("imports (fresh interpreter):", result["imports_s"])

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        result["job_costs"] = job_costs(tmp)
        if not quick:
            paper = run_sweep(tmp, "paper", ["+experiment=paper"])
            result["paper_tracking_local"] = split(paper["records"], paper["wall_s"])
            result["paper_table"] = (tmp / "paper" / "paper_table.md").read_text()
            print("paper experiment (basic launcher, MLflow sqlite):",
                  json.dumps(result["paper_tracking_local"], indent=1))
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
    result["machine_at_end"] = machine()
    print("load average at end (1, 5, 15 min):", result["machine_at_end"].get("load_average_1_5_15"))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {RESULT.relative_to(REPO)}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="imports + job costs (single run, budget_curves)")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
