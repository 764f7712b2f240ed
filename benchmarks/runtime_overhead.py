"""CPU cost of running a plan, against plain eager and its peers, on the same training steps.

    python benchmarks/runtime_overhead.py            # TinyGPT at 2 / 8 / 32 layers
    python benchmarks/runtime_overhead.py --quick    # the same depths, fewer timed rounds

Variants, each one training step (forward, fp32 cross entropy, backward) of the same TinyGPT on the
same batch from the same seed:
- eager: plain PyTorch;
- checkpoint: every layer under `torch.utils.checkpoint.checkpoint(use_reentrant=False)` (HF's
  per-block gradient checkpointing);
- save_on_cpu: `torch.autograd.graph.save_on_cpu()` around the step;
- offload_hooks: a torchtune-style offload (saved_tensors_hooks that copy every activation of at
  least 1 KiB to host memory at pack time and return the copy at unpack; parameters stay);
- runtime_keep_all / runtime_slackswap: `slackswap.runtime.apply` with the keep_all plan and with
  slackswap's plan at 70 % of the keep-all peak; steady-state steps (the first, verified step of a run
  is a warm-up, like a compilation);
- export_eager / export_compiled: slackswap's plan made for the export (the same budget), exported to
  selective checkpointing (`slackswap.runtime.export`), eager and with each layer torch.compile'd
  (inductor; compiled in the warm-up step). The eager export's first step (the warm-up) is its audited
  one; the timed steps run from that step's per-call decisions (`PlanExport.call_table`);
- torch_sac_same_decisions: PyTorch's own mechanism making the export's eager decisions: each layer
  under `torch.utils.checkpoint.checkpoint(use_reentrant=False, context_fn=partial(
  create_selective_checkpoint_contexts, policy))`, `policy` a hand-written lookup keyed by op overload
  and its call count in the layer, decided once from the export's audited decisions
  (`runtime_overhead_export.same_decisions_policy`). Checked before the timed rounds (an assertion,
  so the two rows compare the same decisions): the same ops saved in every layer, the same bytes in
  the checkpoint caches (`checkpoint_cached_bytes`), the same loss and gradients bit for bit. Where the
  export offloads, torch 2.13's eager SAC recomputes (`MUST_CPU_OFFLOAD` is no offload in eager):
  `export_offloaded_bytes_torch_recomputes`. export_eager's `ratio_to_torch_sac_same_decisions`: the
  paired ratio of the two rows (target <= 1).

Timing: CPU time of the process (`time.process_time`), one core, one intra-op thread, the variants
interleaved round by round, 25 rounds with `--quick`, 61 without. `cpu_s_per_step` is the least over
rounds (timeit's rule: noise on a shared machine only adds time), with the median beside it
(`cpu_s_per_step_median`). `ratio_to_eager` is paired: the median over rounds of the variant's time
over eager's in the same round. Why: on the shared 2-core machine of record the speed of the machine
drifts within a run (each variant's least lies at 0.62-0.86 of its median in one run), so the least of
one row and the least of eager come from different machine states, and their quotient moved by up to
about 0.15 from one run to the next (keep_all, whose steps make eager's calls, read 0.89x at 2 layers
and 1.25x at 8 in one run); a round's variants run within a few hundred milliseconds of each other,
in one state. The quotient of the leasts is kept beside it (`ratio_to_eager_of_minima`), and so are
the attribution rows' ratios (`ratio_to_eager_*`, paired in the same rounds). Read the keep_all row,
whose steps do what eager's do, as the noise floor of a run. `aten_calls`: ATen calls a counting dispatch
mode sees in one extra step (null for the compiled variant: a dispatch mode switches compile off).
`peak_bytes`: the peak of CPU bytes allocated during one extra step above its start, from the
profiler's memory events (one per allocation and per free, whichever code made it: activations,
gradients, temporaries, host copies).
`copy_cpu_s_per_step` (runtime_slackswap): CPU time of the copies themselves (allocation and memcpy
of every offload and prefetch), from an attribution run of the same plan with
`CpuCopies(measure=True)` after each round (its clock reads stay out of the timed row): on the CPU
the stand-in copies run on the compute thread; on a GPU the copy engines do that work, so
`ratio_to_eager_without_copies` is the runtime's own cost. `ratio_to_eager_no_data_copies`
(runtime_slackswap): the same plan with a copy engine that moves no data (`NoDataCopies`), timed
interleaved with the rest: the runtime's own cost measured directly. `ratio_to_eager_same_copies_plain_hooks`
(runtime_slackswap): two-line saved-tensor hooks making the same plan's copies (each swapped tensor
copied to a host buffer made once, at its pack; cloned back at its unpack), with no plan positions,
releases or checks: what these copies cost on this CPU by the simplest hooks, the floor under the
runtime's row. `ratio_to_eager_identity_hooks` (runtime_slackswap): saved-tensor hooks that return
their argument, timed interleaved: what autograd's calls into Python cost per saved tensor before a
hook does anything, the floor under both hook rows. `ratio_to_eager_unchecked_program` (runtime_slackswap): the
runtime's own hook program for the plan (offloads at the packs, prefetches at the unpacks the plan's
positions put them at, reads from the copies it names) run by hooks that check nothing and call the
copies inline, timed interleaved: what executing the plan's schedule costs before the runtime's checks
and copy-engine layer (null, with `unchecked_program_refusal`, for a program with other operations).
`ratio_to_eager_every_hidden_swap` (runtime_slackswap): the runtime on slackswap's plan with every swap
that hides left in (`only_needed_swaps: false`, the plans before slackswap dropped the swaps its budget
does not need), timed interleaved, with that plan's `plan_offloads_every_hidden_swap` and
`planned_saved_bytes_every_hidden_swap`: the same runtime on the plan with the most transfers.
`hooks_s_per_step` and `plain_hooks_s_per_step`
(runtime_slackswap): seconds per step inside the runtime's saved-tensor hooks and inside those
plain hooks (`time.perf_counter` around each call, the least over as many extra steps as rounds):
whether the gap between the two rows is the hooks' own code. `overhead_s_per_aten_call` and
`overhead_s_per_saved_tensor` (runtime rows): CPU seconds over eager (`ratio_to_eager` - 1 times eager's
`cpu_s_per_step`) divided by the plain step's ATen calls and by the tensors autograd saves (`saved_tensors`).
`planned_saved_bytes` (plan-driven rows): bytes of the tensors the plan keeps on the device, priced on the
graph the plan was made on. The export rows run slackswap's plan made for the export
(`slackswap.experiment.export_plan.plan_for_export`, the same budget): export_eager the plan made for eager,
export_compiled the plan made for the compiled export (`compile=True`: each layer's dropout mask priced
bool, as the compiled step stores it), and add `export_saved_bytes`: eager, measured in one extra step, every
distinct storage the step saves for backward (the layers' checkpoint caches and what autograd saves,
`PlanExport.counting_saved`); compiled, the partitions' saved activations plus the tensors autograd holds
outside them whatever the policy (outside every layer, the layers' outputs, the layer inputs the
checkpoints hold), with `export_saved_unplanned_bytes` (values the plan does not name),
`export_differences_by_reason`, `export_offloaded_equals_planned` and the masks as the plan prices them
(`export_dropout_mask_planned_bytes`) beside eager's noise (`export_dropout_noise_eager_bytes`). In both
rows `export_saved_bytes` equals `planned_saved_bytes` (`export_saved_equals_planned`). Both add
`export_offloaded_bytes` against `planned_offloaded_bytes`, `export_differences` (decisions PyTorch
executes otherwise, each named by `slackswap.runtime.export`), and the simulated step time of the plan
made for the export beside slackswap's own plan (`sim_step_s_plan_for_export`,
`sim_step_s_slackswap_plan`, H200 preset): what keeping PyTorch's fixed tensors costs.

Writes benchmarks/results/runtime_overhead.json: a list of rows, one per variant and depth.

The code: `runtime_overhead_variants.py` (the variants and the rows), `runtime_overhead_hooks.py` (the
attribution hooks), `runtime_overhead_export.py` (the export rows' accounting),
`runtime_overhead_measures.py` (step, peak bytes, paired ratio, the no-data copy engine).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import RESULTS, machine, pin_one_core  # noqa: E402
from benchmarks.runtime_overhead_measures import NoDataCopies, paired_ratio, peak_cpu_bytes  # noqa: E402
from benchmarks.runtime_overhead_variants import (  # noqa: E402
    BUDGET_FRACTION,
    DEPTHS,
    MIN_OFFLOAD_BYTES,
    SHAPE,
    VARIANTS,
    Variants,
)

__all__ = ["BUDGET_FRACTION", "DEPTHS", "MIN_OFFLOAD_BYTES", "SHAPE", "VARIANTS", "NoDataCopies", "Variants",
           "main", "paired_ratio", "peak_cpu_bytes"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--depths", type=int, nargs="*", default=list(DEPTHS))
    parser.add_argument("--out", type=Path, default=RESULTS / "runtime_overhead.json")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    pinned = pin_one_core()
    start = machine()
    rows = []
    for layers in args.depths:
        rows += Variants(layers).run(rounds=25 if args.quick else 61)
    end = machine()
    for row in rows:
        row.update(load_average_start=start["load_average_1_5_15"], load_average_end=end["load_average_1_5_15"],
                   pinned_cpus=pinned, quick=args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"load average {start['load_average_1_5_15']} -> {end['load_average_1_5_15']}")
    print(f"{'variant':18} {'layers':>6} {'cpu ms':>8} {'x eager':>8} {'(minima)':>8} {'aten':>7} {'peak B':>10}")
    for r in rows:
        print(f"{r['variant']:18} {r['layers']:>6} {r['cpu_s_per_step'] * 1e3:8.2f} {r['ratio_to_eager']:8.2f} "
              f"{r['ratio_to_eager_of_minima']:8.2f} {str(r['aten_calls']):>7} {r['peak_bytes']:>10}")
    return rows


if __name__ == "__main__":
    main()
