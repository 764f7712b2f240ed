"""Planner figures: time vs layers, the seed's setting table, and the smallest feasible budget.

Run: `python benchmarks/bench_planners.py` (one core is enough; pin with `taskset -c 0` to measure
single-core time). Prints three tables and writes benchmarks/results/planners.json:

1. planning wall time (best of 3) of every planner on the Llama-2-70B shape truncated to
   8/16/32/64/80 layers at 50 % of the keep-all peak (slackswap must stay under 1 s at 80 layers);
2. the seed's setting (a100_80gb_pcie4, 50 % budget, bert_large / gpt2_xl / llama7b): simulated
   throughput ratio of every planner, slackswap against the paper's 96.3 / 97.6 / 99.6;
3. the smallest feasible budget fraction of every planner on every preset (bisection to 0.005,
   `slackswap.planners.support.min_budget`), the found plan re-checked in the simulator.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slackswap.errors import InfeasibleBudgetError  # noqa: E402
from slackswap.hardware import Hardware  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.planners.support.min_budget import min_feasible_fraction  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402
from slackswap.schedule.build import keep_all_plan  # noqa: E402
from slackswap.simulate import simulate  # noqa: E402

CONF = ROOT / "conf"
PLANNERS = ("slackswap", "slackswap_seed", "capuchin", "recompute_knapsack", "selective_recompute",
            "full_recompute", "swap_only", "keep_all")
PAPER = {"bert_large": 0.963, "gpt2_xl": 0.976, "llama7b": 0.996}
PRESETS = ("tiny", "bert_large", "gpt2_xl", "llama7b", "llama2_70b")


def model(name: str, **over) -> ModelConfig:
    return ModelConfig.from_dict({**yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()), **over})


def hardware(name: str = "a100_80gb_pcie4") -> Hardware:
    return Hardware.from_dict(yaml.safe_load((CONF / "hardware" / f"{name}.yaml").read_text()))


def timing(hw: Hardware) -> list[dict]:
    rows = []
    print("planning wall time [s] vs layers (llama2_70b shape, 50 % budget, best of 3)")
    print(f"{'planner':22s}" + "".join(f"{n:>9d}" for n in (8, 16, 32, 64, 80)))
    graphs = {}
    for n in (8, 16, 32, 64, 80):
        g = build_graph(model("llama2_70b", num_layers=n), hw)
        graphs[n] = (g, simulate(g, keep_all_plan(g), hw, None).peak_activation_bytes)
    for name in PLANNERS:
        cells = []
        for n, (g, peak) in graphs.items():
            best = float("inf")
            outcome = "plan"
            for _ in range(3):
                t0 = time.perf_counter()
                try:
                    get_planner(name).plan(g, hw, int(0.5 * peak))
                except InfeasibleBudgetError:
                    outcome = "infeasible"
                best = min(best, time.perf_counter() - t0)
            rows.append({"planner": name, "layers": n, "plan_wall_s": best, "outcome": outcome})
            cells.append(f"{best:9.3f}")
        print(f"{name:22s}" + "".join(cells))
    return rows


def seed_table(hw: Hardware) -> list[dict]:
    rows = []
    print("\nseed setting: a100_80gb_pcie4, 50 % budget; throughput ratio = ideal step / simulated step")
    print(f"{'planner':22s}" + "".join(f"{m:>14s}" for m in PAPER))
    results: dict[str, dict[str, float | None]] = {p: {} for p in PLANNERS}
    for m in PAPER:
        g = build_graph(model(m), hw)
        ideal = simulate(g, keep_all_plan(g), hw, None)
        budget = int(0.5 * ideal.peak_activation_bytes)
        for name in PLANNERS:
            try:
                plan = get_planner(name).plan(g, hw, budget)
            except InfeasibleBudgetError as exc:
                results[name][m] = None
                rows.append({"planner": name, "model": m, "feasible": False, "reason": exc.reason})
                continue
            r = simulate(g, plan, hw, budget)
            ratio = ideal.step_s / r.step_s if r.feasible else None
            results[name][m] = ratio
            rows.append({"planner": name, "model": m, "feasible": r.feasible, "throughput_ratio": ratio,
                         "step_s": r.step_s, "ideal_step_s": ideal.step_s, "recompute_s": r.recompute_s,
                         "stall_s": r.stall_prefetch_s + r.stall_memory_s,
                         "peak_activation_bytes": r.peak_activation_bytes, "budget_bytes": budget})
    for name in PLANNERS:
        print(f"{name:22s}" + "".join(
            f"{'infeasible':>14s}" if results[name][m] is None else f"{100 * results[name][m]:13.2f}%" for m in PAPER))
    print(f"{'paper (slackswap)':22s}" + "".join(f"{100 * PAPER[m]:13.1f}%" for m in PAPER))
    print(f"{'delta slackswap-paper':22s}" + "".join(
        f"{100 * (results['slackswap'][m] - PAPER[m]):+13.2f}pp" for m in PAPER))
    return rows


def min_budgets(hw: Hardware) -> list[dict]:
    rows = []
    print("\nsmallest feasible budget fraction of the keep-all peak (bisection, tol 0.005)")
    print(f"{'planner':22s}" + "".join(f"{m:>12s}" for m in PRESETS))
    table: dict[str, list[str]] = {p: [] for p in PLANNERS}
    for m in PRESETS:
        g = build_graph(model(m), hw)
        peak = simulate(g, keep_all_plan(g), hw, None).peak_activation_bytes
        for name in PLANNERS:
            planner = get_planner(name)
            res = min_feasible_fraction(planner, g, hw, peak, lo=0.01, tol=0.005)
            checked = None
            if res.fraction is not None:
                budget = int(res.fraction * peak)
                checked = simulate(g, planner.plan(g, hw, budget), hw, budget).feasible
            rows.append({"planner": name, "model": m, "min_fraction": res.fraction,
                         "largest_infeasible_fraction": res.infeasible_fraction, "reason_below": res.reason,
                         "simulator_feasible": checked})
            table[name].append("-" if res.fraction is None else f"{res.fraction:.3f}")
    for name in PLANNERS:
        print(f"{name:22s}" + "".join(f"{c:>12s}" for c in table[name]))
    return rows


def main() -> None:
    hw = hardware()
    out = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "timing_vs_layers": timing(hw),
        "seed_setting": seed_table(hw),
        "min_budget_fraction": min_budgets(hw),
    }
    path = ROOT / "benchmarks" / "results" / "planners.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
