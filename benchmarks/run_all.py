"""Every benchmark in one command, and the figures of record in one table.

    python benchmarks/run_all.py --quick   # simulate, planners (scaling + seed table), pipeline job costs
    python benchmarks/run_all.py           # every bench_*.py, the pipeline A/Bs included

Each benchmark runs in its own process (the engine and planner benchmarks pin themselves to one
core; the pipeline benchmark must keep both) and writes its JSON to benchmarks/results/. This script
then writes benchmarks/results/summary.json and summary.md: each figure beside the figure measured
before the speed work and its target, with the machine load
(docs/decisions/0019-speed-targets-and-how-they-are-judged.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import RESULTS, machine  # noqa: E402

QUICK = ("bench_simulate.py", "bench_planners.py", "bench_traced_80.py", "bench_pipeline.py", "runtime_overhead.py")
#: Every benchmark of the directory, the quick three first.
FULL = (*QUICK, *sorted(p.name for p in (REPO / "benchmarks").glob("bench_*.py") if p.name not in QUICK))

#: Figures measured on the code before the speed work (docs/decisions/0019-speed-targets-and-how-they-are-judged.md).
BEFORE = {
    "slackswap_k": 1.42,
    "swap_only_k": 1.37,
    "slackswap_80_s": 0.25,
    "slackswap_320_s": 1.86,
    "slackswap_traced_80_s": 63.0,  # before the chain fix (docs/decisions/0019-...-judged.md)
    "engine_ratio": 1.3,
    "engine_us_per_op": 17.0,
    "marginal_job_s": 0.65,
    "budget_curves_s": 184.0,
    "single_run_s": 4.0,
}


def figures() -> list[tuple[str, str, str, str]]:
    """(figure, measured now, before, target) rows from the result files."""
    sim = json.loads((RESULTS / "simulate.json").read_text())
    plan = json.loads((RESULTS / "planners.json").read_text())
    pipe = json.loads((RESULTS / "pipeline.json").read_text())
    rows = []
    k_ref = plan["scaling"]["k_reference"]
    rows.append(("linear reference exponent (machine effect)", f"{k_ref:.2f}", "-", "1.00 on an idle machine"))
    for name, r in plan["scaling"]["planners"].items():
        if name == "reference":
            continue
        before = BEFORE.get(f"{name}_k")
        rows.append((f"{name}: k (load-corrected k_excess)", f"{r['k']:.2f} ({r['k_excess']:.2f})",
                     "-" if before is None else f"{before:.2f}", "<= 1.15"))
    traced = plan.get("traced_scaling")
    if traced is not None:
        sizes = "/".join(str(n) for n in traced["planners"]["slackswap"]["layers"])
        rows.append((f"traced Llama-2-70B, {sizes} layers: linear reference exponent", f"{traced['k_reference']:.2f}",
                     "-", "-"))
        for name, r in traced["planners"].items():
            if name != "reference":
                rows.append((f"traced: {name}: k (load-corrected k_excess)", f"{r['k']:.2f} ({r['k_excess']:.2f})",
                             "-", "<= 1.15"))
    slack = plan["scaling"]["planners"]["slackswap"]
    by_layers = dict(zip(slack["layers"], slack["cpu_s"], strict=True))
    rows.append(("slackswap 80 layers, one core (CPU s)", f"{by_layers.get(80, float('nan')):.3f}",
                 f"{BEFORE['slackswap_80_s']}", "-"))
    rows.append(("slackswap 320 layers, one core (CPU s)", f"{by_layers.get(320, float('nan')):.3f}",
                 f"{BEFORE['slackswap_320_s']}", "< 0.5"))
    row80 = next(r for r in sim["rows"] if r["layers"] == 80)
    traced_80_file = RESULTS / "traced_80.json"
    traced_80 = json.loads(traced_80_file.read_text()) if traced_80_file.exists() else {}
    if "planner_cpu_s" in traced_80:
        rows.append((f"slackswap, traced Llama-2-70B {traced_80['layers']} layers ({traced_80['ops']} ops), one core "
                     "(CPU s)", f"{traced_80['planner_cpu_s']['slackswap']:.3f}", f"{BEFORE['slackswap_traced_80_s']}",
                     "< 5"))
    rows.append(("engine vs linear SimPy, 80 layers (SimPy / engine)", f"{row80['ratio_simpy_over_engine']:.2f}x",
                 f"{BEFORE['engine_ratio']}x", ">= 5x"))
    rows.append(("same, engine + building every TraceEvent, 80 layers",
                 f"{row80['ratio_simpy_over_engine_events']:.2f}x", "-", "-"))
    rows.append(("simulate() incl. validation vs SimPy, 80 layers", f"{row80['ratio_simpy_over_simulate']:.2f}x",
                 "-", "-"))
    largest = max(sim["rows"], key=lambda r: r["layers"])
    rows.append((f"engine vs linear SimPy, {largest['layers']} layers (SimPy / engine; with events)",
                 f"{largest['ratio_simpy_over_engine']:.2f}x ({largest['ratio_simpy_over_engine_events']:.2f}x)",
                 "-", "-"))
    rows.append(("engine us per op, 80 layers (simulate incl. validation)",
                 f"{row80['engine_us_per_op']:.2f} ({row80['simulate_us_per_op']:.2f})",
                 f"{BEFORE['engine_us_per_op']}", "-"))
    jc = pipe["job_costs"]
    rows.append(("marginal cost per sweep job, wall s (CPU s)",
                 f"{jc['marginal_job_wall_s']:.3f} ({jc['marginal_job_cpu_s']:.3f})",
                 f"{BEFORE['marginal_job_s']}", "<= 0.25"))
    rows.append(("  same, without milp's solver time, wall s", f"{jc['marginal_job_wall_s_without_milp_work']}",
                 "-", "<= 0.25"))
    bc = jc["budget_curves"]
    rows.append((f"budget_curves ({bc['jobs']} jobs), wall s (CPU s)", f"{bc['wall_s']:.1f} ({bc['cpu_s']:.1f})",
                 f"{BEFORE['budget_curves_s']:.0f}", "<= 90 on 2 cores"))
    single = jc["single_run"]
    rows.append(("single run on an existing database, wall s (CPU s)",
                 f"{single['wall_s']:.2f} ({single['cpu_s']:.2f})", f"{BEFORE['single_run_s']}", "<= 2.5"))
    overhead_file = RESULTS / "runtime_overhead.json"
    if overhead_file.exists():
        ro = json.loads(overhead_file.read_text())
        for variant, target in (("runtime_keep_all", "<= 1.15"), ("runtime_slackswap", "<= 1.3"),
                                ("export_eager", "-"), ("torch_sac_same_decisions", "-"),
                                ("export_compiled", "-")):
            by_depth = {r["layers"]: r["ratio_to_eager"] for r in ro if r["variant"] == variant}
            if not by_depth:  # a record from before the row existed
                continue
            rows.append((f"{variant}: CPU time per step / eager, "
                         f"{'/'.join(str(k) for k in sorted(by_depth))} layers",
                         " / ".join(f"{by_depth[k]:.2f}" for k in sorted(by_depth)), "-", target))
        by_depth = {r["layers"]: r["ratio_to_torch_sac_same_decisions"] for r in ro
                    if r["variant"] == "export_eager" and "ratio_to_torch_sac_same_decisions" in r}
        if by_depth:
            rows.append(("export_eager: CPU time per step / torch SAC making the same decisions, "
                         f"{'/'.join(str(k) for k in sorted(by_depth))} layers",
                         " / ".join(f"{by_depth[k]:.2f}" for k in sorted(by_depth)), "-", "<= 1.0"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    start = machine()
    t0 = time.perf_counter()
    walls = {}
    for script in QUICK if args.quick else FULL:
        t = time.perf_counter()
        cmd = [sys.executable, str(REPO / "benchmarks" / script), *(["--quick"] if args.quick else [])]
        print(f"== {script}", flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
        walls[script] = round(time.perf_counter() - t, 1)
    total = time.perf_counter() - t0
    rows = figures()
    end = machine()
    lines = [
        f"# Benchmark summary ({'--quick' if args.quick else 'full'}), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Machine: {start['cpus']} CPUs, Python {start['python']}; load average (1/5/15 min) "
        f"{start['load_average_1_5_15']} at start, {end['load_average_1_5_15']} at end. "
        f"Total {total:.0f} s ({', '.join(f'{k} {v} s' for k, v in walls.items())}).",
        "",
        "| figure | now | before | target |",
        "|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
        "",
    ]
    (RESULTS / "summary.md").write_text("\n".join(lines))
    (RESULTS / "summary.json").write_text(json.dumps(
        {"quick": args.quick, "total_wall_s": round(total, 1), "script_wall_s": walls, "machine_at_start": start,
         "machine_at_end": end, "figures": [dict(zip(("figure", "now", "before", "target"), r, strict=True))
                                            for r in rows]}, indent=2) + "\n")
    print("\n".join(lines))
    print(f"wrote {(RESULTS / 'summary.md').relative_to(REPO)}")


if __name__ == "__main__":
    main()
