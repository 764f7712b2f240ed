"""What the caching-allocator replay (`simulate.allocator=caching`) costs next to the simulation.

Run: `python benchmarks/bench_allocator.py`. Graph: the Llama-2-70B preset with `num_layers`
overridden, on a100_80gb_pcie4; plan: slackswap's at 50 % of the keep-all peak. Timed, best of
REPEATS: `simulate(...)` and `allocator_report(...)` (copy resolution, the step's allocation sequence
and its two replays, with no capacity and with the budget as capacity). Writes
benchmarks/results/allocator.json.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slackswap.hardware import Hardware  # noqa: E402
from slackswap.memory.allocator_replay import allocator_report, memory_ops  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402
from slackswap.simulate import simulate  # noqa: E402
from slackswap.simulate.metrics import simulate_ideal  # noqa: E402

LAYERS = (8, 32, 80)
REPEATS = 3


def _best(fn, *args) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    conf = REPO / "conf"
    hardware = Hardware.from_dict(yaml.safe_load((conf / "hardware/a100_80gb_pcie4.yaml").read_text()))
    base = yaml.safe_load((conf / "model/llama2_70b.yaml").read_text())
    rows = []
    for layers in LAYERS:
        graph = build_graph(ModelConfig.from_dict({**base, "num_layers": layers}), hardware)
        budget = simulate_ideal(graph, hardware).peak_activation_bytes // 2
        plan = get_planner("slackswap").plan(graph, hardware, budget)
        result = simulate(graph, plan, hardware, budget)
        report = allocator_report(graph, plan, result, budget)
        row = {
            "layers": layers,
            "steps": len(plan.steps),
            "allocator_calls": len(memory_ops(graph, plan, result)),
            "simulate_s": _best(simulate, graph, plan, hardware, budget),
            "allocator_replay_s": _best(allocator_report, graph, plan, result, budget),
            "peak_reserved_bytes": report.peak_reserved_bytes,
            "fragmentation_share": report.fragmentation_share,
            "fits_reserved": report.fits,
        }
        rows.append(row)
        print(
            f"{layers:4d} layers, {row['allocator_calls']:6d} allocator calls: simulate {row['simulate_s']:.3f} s, "
            f"allocator replay {row['allocator_replay_s']:.3f} s, fragmentation {row['fragmentation_share']:.1%}"
        )
    out = REPO / "benchmarks/results/allocator.json"
    out.write_text(json.dumps({"python": platform.python_version(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
