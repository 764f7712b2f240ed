"""How steady the preset fit is across shapes: hf_gpt2_2l's op times measured at micro-batch 2 / seq 128
(the fit's shape, A) and at micro-batch 4 / seq 192 (B), `--tables` times, one after the other; per
round the preset fitted on A's ops (`slackswap.profile.fit.fit_preset`: on every op, and its check fit
without every 5th op, which is what the preset used to be) times B's ops by the roofline, against B's
sum of op medians, B's plain step (the profile's) and B's keep_all training steps (median of 5 after
the first, as `benchmarks/measured_profile.py`'s cross-shape row measures them). Target: within 15 %.

    python benchmarks/cross_shape_fit.py [--tables 10] [--threads 1]   # -> results/cross_shape_fit.json

Why: the measured-profile benchmark's cross-shape row, one round per run then, read -35.5 to +15.5 %
over 12 runs of one afternoon; this separates the fit's spread (the same A and B measured over and
over) from the measured step's. `benchmarks/measured_profile.py` now runs three of these rounds
(`cross_shape_round`) for its row. CPU here; each round measures both shapes afresh (about 2 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples" / "byo_model")]

from benchmarks.common import machine, save_result  # noqa: E402

TARGET = 0.15


def cross_shape_round(model, other, spec, hardware, device: str = "cpu", clock: str = "wall",
                      step_clock=time.perf_counter) -> dict:
    """One round: `model`'s op times (the fit's shape, A) and `other`'s (B) measured on `clock`, each
    followed by its keep_all training steps on `step_clock` (1 + 5, the first left out), seconds apart;
    the preset fitted on A (on every op, and the check fit) timing B's ops, against B's op sum, plain
    step and training steps (`vs_*`: predicted over measured, minus 1). `benchmarks/measured_profile.py`
    runs three for its cross-shape row."""
    from slackswap.planners.registry import get_planner
    from slackswap.profile.fit import fit_preset, roofline_step_s
    from slackswap.runtime import capture_graph
    from slackswap.runtime.op_times import measure_op_times
    from slackswap.runtime.train import train_steps
    from slackswap.runtime.training_workload import build_training_workload

    measured = {}
    for label, shape in (("A", model), ("B", other)):
        w = build_training_workload(shape, spec, device, 0)
        graph = capture_graph(w.model, (w.batch,), w.loss_fn, hardware, label)
        table = measure_op_times(graph, w.model, (w.batch,), w.loss_fn, 2, 5, clock)
        plan = get_planner("keep_all").plan(graph, hardware, None)
        steps = [r.step_s for r in train_steps(w, graph, plan, 6, 1e-4, 0, clock=step_clock)][1:]
        measured[label] = {"graph": graph, "medians": {k: t.median_s for k, t in table.times.items()},
                           "op_sum_s": table.measured_sum_s, "plain_step_s": table.step_median_s,
                           "train_step_s": statistics.median(steps), "dtype": shape.dtype}
    a, b = measured["A"], measured["B"]
    report = fit_preset(a["graph"], a["medians"], hardware, a["dtype"])
    row = {"b_op_sum_s": b["op_sum_s"], "b_plain_step_s": b["plain_step_s"], "b_train_step_s": b["train_step_s"],
           "a_op_sum_s": a["op_sum_s"], "holdout_median_rel_error": report.holdout_median_rel_error,
           "load": round(os.getloadavg()[0], 2)}
    for fit, preset in (("every_op", report.hardware), ("check_fit", report.check_hardware)):
        predicted = roofline_step_s(b["graph"], preset, b["dtype"])
        row[fit] = {"predicted_s": predicted, "hbm_efficiency": preset.hbm_efficiency,
                    "launch_overhead_s": preset.launch_overhead_s,
                    "half_performance_flops": dict(preset.half_performance_flops),
                    **{f"vs_{k}": predicted / b[f"{k}_s"] - 1 for k in ("op_sum", "plain_step", "train_step")}}
    return row


def summary(rows: list[dict]) -> dict:
    """Per fit and per measured side: the median error, its range and the rounds within the target."""
    out = {}
    for fit in ("every_op", "check_fit"):
        for side in ("op_sum", "plain_step", "train_step"):
            errors = [r[fit][f"vs_{side}"] for r in rows]
            out[f"{fit}_vs_{side}"] = {"median": statistics.median(errors), "min": min(errors), "max": max(errors),
                                       "within_15pct": sum(abs(e) <= TARGET for e in errors), "rounds": len(errors)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=10, help="rounds, each measuring both shapes (>= 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (>= 1)")
    args = parser.parse_args(argv)
    if args.tables < 2:
        raise SystemExit(f"error: --tables={args.tables}: must be >= 2")
    if args.threads < 1:
        raise SystemExit(f"error: --threads={args.threads}: must be >= 1")
    import torch

    from benchmarks.measured_cases import HARDWARE, cases
    from slackswap.hardware import load_preset

    torch.set_num_threads(args.threads)
    _, model, spec = cases()[0]
    other = replace(model, micro_batch_size=model.micro_batch_size * 2, seq_len=model.seq_len // 2 * 3)
    hardware, started, t0 = load_preset(HARDWARE), machine(), time.perf_counter()
    rows = []
    for k in range(args.tables):
        row = cross_shape_round(model, other, spec, hardware)
        rows.append(row)
        every, check = row["every_op"]["predicted_s"], row["check_fit"]["predicted_s"]
        print(f"[round {k}] B: op sum {row['b_op_sum_s'] * 1e3:.1f} ms, plain step {row['b_plain_step_s'] * 1e3:.1f}, "
              f"train step {row['b_train_step_s'] * 1e3:.1f}; predicted on every op {every * 1e3:.1f}, on the check "
              f"fit {check * 1e3:.1f}; load {row['load']}", flush=True)
    s = summary(rows)
    for key, v in s.items():
        print(f"[{key}] median {v['median'] * 100:+.1f} %, range {v['min'] * 100:+.1f} to {v['max'] * 100:+.1f} %, "
              f"within 15 %: {v['within_15pct']}/{v['rounds']}")
    save_result("cross_shape_fit.json", {
        "fitted_on": f"mb {model.micro_batch_size} seq {model.seq_len}",
        "predicted_for": f"mb {other.micro_batch_size} seq {other.seq_len}", "hardware_preset": HARDWARE,
        "torch_threads": args.threads, "machine_start": started, "machine_end": machine(), "rounds": rows,
        "summary": s, "wall_s": time.perf_counter() - t0})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
