"""What the runtime's inline CPU copies cost inside a training step, against the copy curve's price.

`python benchmarks/copies_in_step.py [--steps 12] [--threads 1]` (CPU). For each of the measured-profile
benchmark's five models (`benchmarks.measured_cases`): slackswap at half the keep-all peak, planned on
the captured graph for the benchmark's preset (swaps only on these models), runs under the eager
runtime with `CpuCopies(measure=True)`, which adds up the CPU time of every inline offload and
prefetch (allocation and memcpy; two clock reads per copy included). The median over the steps after
the first is set beside what two profile measurements price the same copies at: the machine
description's copy curve, measured by `slackswap.profile.torch.links` in the same run (`Machine.copy_s`
per copy), and the tensors' copy times as a CPU op-time table measures them
(`slackswap.runtime.eager.copy_times`: stamped in profiling steps of the save_on_cpu plan, on the same
CPU-time clock), which `slackswap.experiment.prediction` adds to a CPU prediction.

Why: with copies priced by that curve, `benchmarks/measured_profile.py` predicted slackswap's swap-only
rows 2-5 pp too little overhead in most runs (docs/profile.md, "The record"). The link's rows time each
copy over and over on the same two buffers, which stay in the caches; in a step, a host buffer was last
written a step before and a tensor fetched back was written in forward. This measurement is why a CPU
op-time table now times each tensor's copies in profiling steps (`slackswap.runtime.eager.copy_times`);
it is a diagnostic, and nothing here feeds a prediction. Results: benchmarks/results/copies_in_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples" / "byo_model")]  # the hook MLP's module (my_model)

from benchmarks.common import machine, save_result  # noqa: E402
from benchmarks.measured_cases import HARDWARE, cases  # noqa: E402

BUDGET_FRACTION = 0.5


def measure(steps: int) -> list[dict]:
    """One row per model (module docstring)."""
    import torch

    from slackswap.experiment.measured_prediction import profiling_plans
    from slackswap.hardware import load_preset
    from slackswap.planners.registry import get_planner
    from slackswap.profile.machine import Machine
    from slackswap.profile.torch.links import measure_links, measurement_description
    from slackswap.runtime import capture_graph
    from slackswap.runtime.copy_engines import CpuCopies
    from slackswap.runtime.eager.copy_times import measure_copy_times
    from slackswap.runtime.eager.run import apply
    from slackswap.runtime.training_workload import build_training_workload
    from slackswap.simulate.metrics import simulate_ideal

    hardware = load_preset(HARDWARE)
    link = Machine.from_dict(measurement_description(measure_links("cpu", 64 * 1024**2, 3), "cpu"))
    rows = []
    for name, model, spec in cases():
        w = build_training_workload(model, spec, "cpu", 0)
        graph = capture_graph(w.model, (w.batch,), w.loss_fn, hardware, name)
        peak = simulate_ideal(graph, hardware).peak_activation_bytes
        plan = get_planner("slackswap").plan(graph, hardware, int(peak * BUDGET_FRACTION))
        sizes = graph.size_bytes_of
        priced_s = (sum(link.copy_s("d2h", sizes[t.tensor]) for t in plan.offloads)
                    + sum(link.copy_s("h2d", sizes[t.tensor]) for t in plan.prefetches))
        copy_plan = profiling_plans(hardware)["copy_plan"](graph)
        profiled, _ = measure_copy_times(graph, copy_plan, w.model, (w.batch,), w.loss_fn, time.process_time_ns)
        missing = sum(t.tensor not in profiled for t in plan.offloads)
        profiled_s = (sum(profiled[t.tensor][0] for t in plan.offloads if t.tensor in profiled)
                      + sum(profiled[t.tensor][1] for t in plan.prefetches if t.tensor in profiled))
        copies = CpuCopies(measure=True)
        run = apply(plan, graph, w.model, copies=copies)
        optimizer = torch.optim.AdamW(w.model.parameters(), lr=1e-4)
        per_step = []
        for _ in range(steps):
            copies.copy_s = 0.0
            with run:
                w.loss_fn(w.model(w.batch)).backward()
            optimizer.step()
            optimizer.zero_grad()
            per_step.append(copies.copy_s)
        in_step_s = statistics.median(per_step[1:])
        rows.append({"model": name, "offloads": len(plan.offloads), "prefetches": len(plan.prefetches),
                     "offloaded_bytes": sum(sizes[t.tensor] for t in plan.offloads),
                     "priced_s": priced_s, "copy_times_s": profiled_s, "copy_times_missing": missing,
                     "in_step_median_s": in_step_s, "in_step_s": per_step[1:],
                     "ratio": in_step_s / priced_s if priced_s else None,
                     "ratio_to_copy_times": in_step_s / profiled_s if profiled_s else None})
        print(f"{name}: {len(plan.offloads)} offloads, {rows[-1]['offloaded_bytes'] / 1e6:.2f} MB; in the step they "
              f"took {in_step_s * 1e3:.3f} ms (CPU time, median of {steps - 1} steps); the copy curve prices them at "
              f"{priced_s * 1e3:.3f} ms ({rows[-1]['ratio']:.2f}x), the tensors' copy times at {profiled_s * 1e3:.3f} "
              f"ms ({rows[-1]['ratio_to_copy_times']:.2f}x; {missing} offloads without one)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per model, the first a warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (CPU time is one thread's)")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit(f"error: --steps={args.steps}: must be >= 2 (the first is a warm-up)")
    if args.threads < 1:
        raise SystemExit(f"error: --threads={args.threads}: must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    started = machine()
    rows = measure(args.steps)
    path = save_result("copies_in_step.json", {"hardware_preset": HARDWARE, "budget_fraction": BUDGET_FRACTION,
                                               "torch_threads": args.threads, "machine_start": started,
                                               "machine_end": machine(), "rows": rows})
    print(f"[saved] {path}", flush=True)


if __name__ == "__main__":
    main()
