"""How long one simulated training step takes as the stack grows (issue 4: < 0.5 s for an 80-layer,
h=8192 model with a mixed swap/recompute plan, on one core; cost about linear in the number of ops).

Run: `python benchmarks/bench_simulate.py` (pins itself to one CPU where the OS allows). Graph:
`build_graph` of the Llama-2-70B preset with `num_layers` overridden, on a100_80gb_pcie4. Plan: in
each layer the saved tensors, in production order, are cycled swap / recompute / keep (recompute only
for forward-produced tensors; others keep), turned into an explicit schedule by the shared
`build_schedule` (ALAP prefetch). Budget: that plan's own unlimited peak, the tightest budget it
meets, so every allocation is checked against a binding limit and the whole step runs (a lower
budget deadlocks at the loss for this plan: the engine then stops early, which would flatter the
timing). Timed: `simulate(...)` end to end (validation + copy resolution +
event loop); validation alone is shown too. Best of several repeats (least disturbed by other load),
median alongside. Writes benchmarks/results/simulate.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slackswap.graph import Graph, Phase  # noqa: E402
from slackswap.hardware import Hardware  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.plan import Decision  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402
from slackswap.schedule.build import build_schedule  # noqa: E402
from slackswap.simulate import resolve_schedule, simulate  # noqa: E402

LAYERS = (8, 32, 80, 160)
REPEATS = 5
CYCLE = (Decision.SWAP, Decision.RECOMPUTE, Decision.KEEP)


def mixed_decisions(graph: Graph) -> dict[str, Decision]:
    index_in_layer: dict[int, int] = {}
    out = {}
    for t in graph.saved_tensors:
        i = index_in_layer.get(t.layer, 0)
        index_in_layer[t.layer] = i + 1
        decision = CYCLE[i % 3]
        forward = graph.op_by_name[t.producer].phase in (Phase.FORWARD, Phase.LOSS)
        out[t.name] = Decision.KEEP if decision == Decision.RECOMPUTE and not forward else decision
    return out


def best_and_median(fn, args: tuple, repeats: int) -> tuple[float, float, object]:
    times, value = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), value


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    model_data = yaml.safe_load((REPO / "conf/model/llama2_70b.yaml").read_text())
    hw = Hardware.from_dict(yaml.safe_load((REPO / "conf/hardware/a100_80gb_pcie4.yaml").read_text()))
    rows = []
    for layers in LAYERS:
        graph = build_graph(ModelConfig.from_dict({**model_data, "num_layers": layers}), hw)
        decisions = mixed_decisions(graph)
        plan = build_schedule(graph, decisions, planner="bench_mixed", budget_bytes=None, hardware=hw)
        budget = simulate(graph, plan, hw, None).peak_activation_bytes
        sim_best, sim_median, result = best_and_median(simulate, (graph, plan, hw, budget), REPEATS)
        val_best, _, _ = best_and_median(resolve_schedule, (graph, plan), REPEATS)
        n_events = len(result.events) + len(result.memory_bytes)
        rows.append(
            {
                "layers": layers,
                "hidden_size": model_data["hidden_size"],
                "ops": len(graph.ops),
                "steps": len(plan.steps),
                "transfers": len(plan.offloads) + len(plan.prefetches),
                "swapped_tensors": result.swapped_tensors,
                "recomputed_tensors": result.recomputed_tensors,
                "events": n_events,
                "feasible": result.feasible,
                "step_s": result.step_s,
                "stall_memory_s": result.stall_memory_s,
                "simulate_best_s": sim_best,
                "simulate_median_s": sim_median,
                "validate_best_s": val_best,
                "us_per_op": sim_best / len(graph.ops) * 1e6,
            }
        )
    header = (
        f"{'layers':>6} {'ops':>6} {'steps':>6} {'xfers':>6} {'swap':>5} {'recomp':>6} {'events':>7} "
        f"{'feasible':>8} {'sim best s':>10} {'median s':>9} {'validate s':>10} {'us/op':>6}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['layers']:>6} {r['ops']:>6} {r['steps']:>6} {r['transfers']:>6} {r['swapped_tensors']:>5} "
            f"{r['recomputed_tensors']:>6} {r['events']:>7} {r['feasible']!s:>8} {r['simulate_best_s']:>10.4f} "
            f"{r['simulate_median_s']:>9.4f} {r['validate_best_s']:>10.4f} {r['us_per_op']:>6.1f}"
        )
    out = {
        "benchmark": "simulate",
        "model": "llama2_70b (num_layers overridden)",
        "hardware": "a100_80gb_pcie4",
        "plan": "per layer cycle swap/recompute/keep over saved tensors; build_schedule (alap); "
        "budget = plan's own unlimited peak",
        "repeats": REPEATS,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "target": "80 layers < 0.5 s on one core",
        "rows": rows,
    }
    path = REPO / "benchmarks/results/simulate.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
