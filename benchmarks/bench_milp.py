"""Optimality gaps against the milp bound on 4-layer models, and how the milp solve time grows.

    python benchmarks/bench_milp.py            # ~5 min on one core
    python benchmarks/bench_milp.py --quick    # gpt2_xl only, no scaling sweep
    taskset -c 1 python benchmarks/bench_milp.py --exact8 gpt2_xl,llama7b   # exact bound at 8 layers only

`--exact8 MODELS`: for each model with num_layers=8 at 0.3/0.5/0.7 of the keep-all peak, only the
exact bound MILP (`MilpPlanner().bound`, 60 s cap): HiGHS status, MIP gap, bound, incumbent and wall
time. Merged per model into the "exact_8_layers" block of milp.json (other blocks untouched).

For gpt2_xl and bert_large with num_layers=4 on a100_80gb_pcie4 at budgets 0.3/0.5/0.7 of the
keep-all peak: the milp bound, then every planner's simulated step and optimality_gap =
step_s / bound_step_s - 1 against that bound. Then the bound's solve time for 4..48 layers (exact up
to 8, LP relaxation of the reduced model beyond). First, the full-size seed workloads' milp wall time.
Prints the figures and saves them to benchmarks/results/milp.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slackswap.errors import InfeasibleBudgetError  # noqa: E402
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.planners.milp import MilpPlanner
from slackswap.planners.registry import available_planners, get_planner
from slackswap.profile import build_graph
from slackswap.schedule.build import keep_all_plan
from slackswap.simulate import simulate

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
RESULT = REPO / "benchmarks" / "results" / "milp.json"
FRACTIONS = (0.3, 0.5, 0.7)


def _load(group: str, name: str) -> dict:
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


def gaps_for(model_name: str, hardware: Hardware, layers: int) -> list[dict]:
    model = ModelConfig.from_dict({**_load("model", model_name), "num_layers": layers})
    graph = build_graph(model, hardware)
    keep = simulate(graph, keep_all_plan(graph), hardware, None)
    rows = []
    for fraction in FRACTIONS:
        budget = int(fraction * keep.peak_activation_bytes)
        t0 = time.perf_counter()
        try:
            milp_plan = MilpPlanner().plan(graph, hardware, budget)
        except InfeasibleBudgetError as exc:
            print(f"{model_name} L={layers} budget {fraction}: milp infeasible: {exc.reason}")
            rows.append({"model": model_name, "layers": layers, "fraction": fraction, "planner": "milp",
                         "feasible": False, "reason": exc.reason})
            continue
        milp_wall = time.perf_counter() - t0
        bound = milp_plan.bound_step_s
        print(f"{model_name} L={layers} budget {fraction}: bound {bound * 1e3:.3f} ms "
              f"(ideal {keep.step_s * 1e3:.3f} ms; {milp_plan.notes['milp_mode']}, "
              f"{milp_plan.notes['milp_status']}, granularity {milp_plan.notes['milp_granularity']}, "
              f"plan {milp_wall:.1f} s)")
        for name in available_planners():
            t0 = time.perf_counter()
            try:
                plan = milp_plan if name == "milp" else get_planner(name).plan(graph, hardware, budget)
            except InfeasibleBudgetError as exc:
                rows.append({"model": model_name, "layers": layers, "fraction": fraction, "planner": name,
                             "feasible": False, "reason": exc.reason, "bound_step_s": bound})
                print(f"    {name:20s} infeasible: {exc.reason[:90]}")
                continue
            plan_wall = milp_wall if name == "milp" else time.perf_counter() - t0
            result = simulate(graph, plan, hardware, budget)
            row = {"model": model_name, "layers": layers, "fraction": fraction, "planner": name,
                   "feasible": result.feasible, "bound_step_s": bound, "ideal_step_s": keep.step_s,
                   "plan_wall_s": plan_wall}
            if result.feasible:
                row.update(step_s=result.step_s, optimality_gap=result.step_s / bound - 1,
                           throughput_ratio=keep.step_s / result.step_s)
                print(f"    {name:20s} step {result.step_s * 1e3:8.3f} ms  gap {row['optimality_gap']:7.2%}  "
                      f"throughput {row['throughput_ratio']:.2%}")
                assert result.step_s >= bound * (1 - 1e-9), f"bound violated by {name}"
            else:
                row["reason"] = result.infeasible_reason
                print(f"    {name:20s} simulated infeasible: {result.infeasible_reason[:80]}")
            rows.append(row)
    return rows


def scaling(model_name: str, hardware: Hardware, layer_counts: tuple[int, ...]) -> list[dict]:
    rows = []
    for layers in layer_counts:
        model = ModelConfig.from_dict({**_load("model", model_name), "num_layers": layers})
        graph = build_graph(model, hardware)
        peak = simulate(graph, keep_all_plan(graph), hardware, None).peak_activation_bytes
        t0 = time.perf_counter()
        solution, granularity = MilpPlanner().bound(graph, hardware, int(0.5 * peak))
        wall = time.perf_counter() - t0
        rows.append({"model": model_name, "layers": layers, "ops": len(graph.ops), "mode": solution.mode,
                     "status": solution.status, "granularity": granularity, "bound_wall_s": wall,
                     "solve_s": solution.solve_s, "bound_step_s": solution.bound_step_s})
        print(f"scaling {model_name} L={layers:3d} ops={len(graph.ops):5d} {solution.mode:7s} {solution.status:24s} "
              f"bound {wall:6.2f} s")
    return rows


def exact_8_layers(model_name: str, hardware: Hardware) -> list[dict]:
    """The exact bound MILP at 8 layers: does HiGHS prove optimality within time_limit_s?"""
    graph = build_graph(ModelConfig.from_dict({**_load("model", model_name), "num_layers": 8}), hardware)
    peak = simulate(graph, keep_all_plan(graph), hardware, None).peak_activation_bytes
    rows = []
    for fraction in FRACTIONS:
        t0 = time.perf_counter()
        try:
            solution, granularity = MilpPlanner().bound(graph, hardware, int(fraction * peak))
        except InfeasibleBudgetError as exc:
            rows.append({"model": model_name, "layers": 8, "fraction": fraction, "status": "infeasible",
                         "reason": exc.reason, "bound_wall_s": time.perf_counter() - t0})
            print(f"exact8 {model_name:10s} {fraction}: infeasible: {exc.reason[:80]}")
            continue
        wall = time.perf_counter() - t0
        rows.append({"model": model_name, "layers": 8, "ops": len(graph.ops), "fraction": fraction,
                     "status": solution.status, "mip_gap": solution.mip_gap, "granularity": granularity,
                     "bound_step_s": solution.bound_step_s, "incumbent_step_s": solution.incumbent_step_s,
                     "bound_wall_s": wall})
        print(f"exact8 {model_name:10s} {fraction}: {solution.status:24s} gap {solution.mip_gap:.2e} "
              f"bound {solution.bound_step_s * 1e3:.4f} ms incumbent {(solution.incumbent_step_s or 0) * 1e3:.4f} ms "
              f"{wall:5.1f} s")
    return rows


def full_scale(hardware: Hardware) -> list[dict]:
    """The seed workloads at full size, 50 % budget: milp bound + plan wall time on one core."""
    rows = []
    for model_name in ("bert_large", "gpt2_xl", "llama7b"):
        graph = build_graph(ModelConfig.from_dict(_load("model", model_name)), hardware)
        keep = simulate(graph, keep_all_plan(graph), hardware, None)
        budget = int(0.5 * keep.peak_activation_bytes)
        t0 = time.perf_counter()
        plan = MilpPlanner().plan(graph, hardware, budget)
        wall = time.perf_counter() - t0
        result = simulate(graph, plan, hardware, budget)
        rows.append({"model": model_name, "layers": graph.num_layers, "ops": len(graph.ops), "plan_wall_s": wall,
                     "bound_nodes": plan.notes["milp_nodes"], "bound_step_s": plan.bound_step_s,
                     "step_s": result.step_s, "optimality_gap": result.step_s / plan.bound_step_s - 1,
                     "plan_source": plan.notes["milp_plan_source"], "mode": plan.notes["milp_mode"]})
        print(f"full {model_name:10s} L={graph.num_layers} milp plan+bound {wall:5.2f} s (bound solve "
              f"{plan.notes['milp_nodes']} nodes), bound {plan.bound_step_s * 1e3:.3f} ms, step "
              f"{result.step_s * 1e3:.3f} ms, gap {rows[-1]['optimality_gap']:.2%}, plan from "
              f"{plan.notes['milp_plan_source']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--exact8", metavar="MODELS", help="comma-separated models: only the 8-layer exact bound")
    args = parser.parse_args()
    hardware = Hardware.from_dict(_load("hardware", "a100_80gb_pcie4"))
    if args.exact8:
        results = {m: exact_8_layers(m, hardware) for m in args.exact8.split(",")}
        data = json.loads(RESULT.read_text()) if RESULT.exists() else {}
        data.setdefault("exact_8_layers", {}).update(results)
        RESULT.write_text(json.dumps(data, indent=1))
        print(f"merged into {RESULT}")
        return
    models = ("gpt2_xl",) if args.quick else ("gpt2_xl", "bert_large")
    full = full_scale(hardware)
    gaps = [row for m in models for row in gaps_for(m, hardware, 4)]
    scale = [] if args.quick else scaling("gpt2_xl", hardware, (4, 8, 16, 32, 48))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(RESULT.read_text()).get("exact_8_layers") if RESULT.exists() else None
    data = {"machine": platform.platform(), "python": platform.python_version(), "hardware": hardware.name,
            "full_scale_50pct": full, "gaps_4_layers": gaps, "scaling": scale}
    if kept:
        data["exact_8_layers"] = kept  # written by --exact8 runs; not re-measured here
    RESULT.write_text(json.dumps(data, indent=1))
    print(f"saved {RESULT}")


if __name__ == "__main__":
    main()
