"""The runtime's measured ledgers against the simulator's peaks, explained to the byte.

    python benchmarks/runtime_ledger.py

For 2-layer toy configs of GPT-2, BERT and Llama (HF classes) and TinyGPT, every planner's plan (at
the tightest of 50/70/90 % of the keep-all peak it meets, else no budget) runs one real CPU step
under the runtime with tracing. Printed per plan: the simulator's peak of every graph tensor and the
ledger's peak of every device storage (`device_peak_bytes`), then the saved-bytes peaks of both (no
budget, a link that takes no time), with the saved ledger's difference split into the copies alive
at its peak that the plan had already released (`late`), with their names. Writes
benchmarks/results/runtime_ledger.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> list[dict]:
    import torch

    from slackswap.planners.registry import available_planners
    from slackswap.runtime.compare import explain_ledger
    from slackswap.simulate import simulate
    from slackswap.simulate.saved_peak import instant_link, simulated_saved_peak_bytes
    from tests.runtime_support import capture, h200, plan_for, run_step

    torch.set_num_threads(1)
    rows = []
    for kind in ("tiny", "gpt2", "bert", "llama"):
        c = capture(kind)
        for planner in available_planners():
            plan, fraction = plan_for(planner, c)
            _, _, report = run_step(c.workload, plan, c.graph, trace=True)
            why = explain_ledger(c.graph, plan, report.live_by_step)
            sim = simulate(c.graph, plan, instant_link(h200()), None).peak_activation_bytes
            row = {"model": kind, "planner": planner, "budget_fraction": fraction,
                   "sim_peak_activation_bytes": sim, "device_peak_bytes": report.device_peak_bytes,
                   "sim_saved_peak_bytes": simulated_saved_peak_bytes(c.graph, plan, h200()),
                   "ledger_peak_bytes": report.ledger_peak_bytes, **why}
            rows.append(row)
            late = ", ".join(f"{name} ({size} B)" for name, _, size in why["late"]) or "-"
            print(f"{kind:6} {planner:20} {fraction} all: sim {sim:>8} measured {report.device_peak_bytes:>8}; "
                  f"saved: sim {row['sim_saved_peak_bytes']:>8} ledger {report.ledger_peak_bytes:>8} "
                  f"= plan@peak {why['plan_bytes_at_ledger_peak']:>8} + late {why['late_bytes']:>6}: {late}")
    out = REPO / "benchmarks" / "results" / "runtime_ledger.json"
    out.write_text(json.dumps(rows, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
