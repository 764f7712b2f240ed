"""How long building + timing the op graph takes, as the stack grows (target: < 1 s for 80 layers of
a Llama-2-70B shape on one core).

Run: `python benchmarks/bench_profile.py` (single process, single thread). Prints a table and writes
benchmarks/results/profile.json. The best of several repeats is reported (least disturbed by other
load on the machine), with the median alongside.
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

from slackswap.hardware import load_preset  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402

LAYERS = (8, 32, 80, 160)
REPEATS = 7


def main() -> None:
    model_data = yaml.safe_load((REPO / "conf/model/llama2_70b.yaml").read_text())
    hw = load_preset("a100_80gb_pcie4")
    rows = []
    for layers in LAYERS:
        model = ModelConfig.from_dict({**model_data, "num_layers": layers})
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            graph = build_graph(model, hw)
            times.append(time.perf_counter() - t0)
        rows.append({"num_layers": layers, "ops": len(graph.ops), "tensors": len(graph.tensors),
                     "best_s": min(times), "median_s": statistics.median(times)})
    print(f"build_graph(llama2_70b shape, a100_80gb_pcie4), best/median of {REPEATS}")
    print(f"{'layers':>7} {'ops':>7} {'tensors':>8} {'best_ms':>9} {'median_ms':>10} {'us/op':>7}")
    for r in rows:
        print(f"{r['num_layers']:>7} {r['ops']:>7} {r['tensors']:>8} {r['best_s'] * 1e3:>9.2f} "
              f"{r['median_s'] * 1e3:>10.2f} {r['best_s'] / r['ops'] * 1e6:>7.2f}")
    r80 = next(r for r in rows if r["num_layers"] == 80)
    print(f"80 layers: {r80['best_s'] * 1e3:.1f} ms (target < 1000 ms)")
    out = {
        "benchmark": "profile",
        "model": "llama2_70b",
        "hardware": "a100_80gb_pcie4",
        "repeats": REPEATS,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "rows": rows,
        "target_80_layers_s": 1.0,
        "meets_target": r80["best_s"] < 1.0,
    }
    path = REPO / "benchmarks/results/profile.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
