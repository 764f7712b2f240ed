"""slackswap's certified gap to the optimum against the milp bound without and with the chain cuts.

Run: `python benchmarks/bench_gaps.py` (about 3 min on one core). For tiny, bert_large, gpt2_xl and
llama7b at 30 / 50 / 70 % of the keep-all peak on a100_80gb_pcie4: slackswap's simulated step, the
milp lower bound with `chain_cuts: false` (the bound before docs/milp.md "Chain cuts") and with
`chain_cuts: true` (the default), and the gap step / bound - 1 against each. The difference between
the two gap columns is bound slack the cuts removed; what is left is planner slack plus whatever
slack the bound still has. Writes benchmarks/results/gaps.json.
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
from slackswap.hardware import load_preset  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402
from slackswap.schedule.build import keep_all_plan  # noqa: E402
from slackswap.simulate import simulate  # noqa: E402

CONF = ROOT / "conf"
MODELS = ("tiny", "bert_large", "gpt2_xl", "llama7b")
FRACTIONS = (0.3, 0.5, 0.7)


def _bound_s(graph, hw, budget: int, chain_cuts: bool) -> float | None:
    try:
        solution, _ = get_planner("milp", heuristic_candidates=(), chain_cuts=chain_cuts).bound(graph, hw, budget)
    except InfeasibleBudgetError:
        return None
    return solution.bound_step_s


def main() -> None:
    hw = load_preset("a100_80gb_pcie4")
    rows = []
    print(f"{'model':11s} {'budget':>6s} {'ratio':>8s} {'step ms':>10s} {'old bound':>10s} {'new bound':>10s}"
          f" {'gap old':>8s} {'gap new':>8s}")
    for name in MODELS:
        model = ModelConfig.from_dict(yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))
        graph = build_graph(model, hw)
        ideal = simulate(graph, keep_all_plan(graph), hw, None)
        for fraction in FRACTIONS:
            budget = int(fraction * ideal.peak_activation_bytes)
            row: dict[str, object] = {"model": name, "budget_fraction": fraction, "budget_bytes": budget}
            try:
                t0 = time.perf_counter()
                plan = get_planner("slackswap").plan(graph, hw, budget)
                row["plan_wall_s"] = time.perf_counter() - t0
                step = simulate(graph, plan, hw, budget).step_s
            except InfeasibleBudgetError as exc:
                row["infeasible_reason"] = exc.reason
                step = None
            old, new = _bound_s(graph, hw, budget, False), _bound_s(graph, hw, budget, True)
            row.update(step_s=step, throughput_ratio=None if step is None else ideal.step_s / step,
                       bound_old_s=old, bound_new_s=new,
                       gap_old=None if step is None or old is None else step / old - 1,
                       gap_new=None if step is None or new is None else step / new - 1)
            rows.append(row)

            def cell(x, scale=1e3, fmt="10.3f"):
                return f"{x * scale:{fmt}}" if x is not None else f"{'-':>{fmt.split('.')[0]}}"

            print(f"{name:11s} {fraction:6.0%} {cell(row['throughput_ratio'], 100, '7.2f')}% {cell(step)}"
                  f" {cell(old)} {cell(new)} {cell(row['gap_old'], 100, '7.2f')}% {cell(row['gap_new'], 100, '7.2f')}%",
                  flush=True)
    out = ROOT / "benchmarks" / "results" / "gaps.json"
    out.write_text(json.dumps({"machine": platform.platform(), "hardware": hw.name, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
