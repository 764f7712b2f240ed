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
  (inductor; compiled in the warm-up step).

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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import RESULTS, machine, pin_one_core  # noqa: E402

VARIANTS = ("eager", "checkpoint", "save_on_cpu", "offload_hooks", "runtime_keep_all", "runtime_slackswap",
            "export_eager", "export_compiled")
DEPTHS = (2, 8, 32)
#: TinyGPT at a width where the CPU's per-call cost matters, as on a GPU (small kernels).
SHAPE = {"hidden": 64, "heads": 4, "seq": 32, "batch": 2, "vocab": 256}
#: 70 % of the keep-all peak: with eager lifetimes counted (Tensor.held_until) no planner meets 50 % of
#: these toy models (the runtime tests plan at 70 % for the same reason).
BUDGET_FRACTION = 0.7
#: torchtune's OffloadActivations leaves tensors under 1 KiB on the device (min_offload_size).
MIN_OFFLOAD_BYTES = 1024


class NoDataCopies:
    """A copy engine that moves no data: the offload keeps the device storage, the prefetch returns
    it (values unchanged, so the step stays exact; memory is not saved). Timing attribution only.
    Like the CPU stand-in (`CpuCopies`) it has nothing in flight, so the runtime does not poll it."""

    needs_poll = False

    def offload(self, source, key=None):
        return source  # arrived at issue, as an inline copy is

    def prefetch(self, offloaded, device):
        return offloaded

    def poll(self) -> None:
        return None

    def close(self) -> None:
        return None


def peak_cpu_bytes(step) -> int:
    """The peak of CPU bytes allocated while `step()` runs, above what was allocated before it.

    The allocator's own record: one `[memory]` event per CPU allocation (bytes > 0) and per free
    (bytes < 0), summed in time order. Read from the profiler's raw results (`kineto_results`, which
    `torch.profiler`'s memory profiler reads too): `prof.events()` builds the op tree first, 2 s per
    step at 32 layers, and attributing bytes to ops through it dropped the allocations no op
    encloses (64-80 KiB of the checkpoint and offload_hooks steps)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    cpu = torch.autograd.DeviceType.CPU
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == cpu)
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def paired_ratio(times_s: list[float], eager_times_s: list[float]) -> float:
    """The median over rounds of a variant's time over eager's in the same round (both lists in round
    order): a ratio of two steps timed in one machine state, where the quotient of two leasts pairs
    states far apart when the machine's speed drifts within a run (module docstring, "Timing")."""
    return statistics.median(t / e for t, e in zip(times_s, eager_times_s, strict=True))


def _step(w) -> None:
    w.loss_fn(w.model(w.batch)).backward()


def _identity(x):
    return x


def _zero(w) -> None:
    for p in w.model.parameters():
        p.grad = None


class Variants:
    """Each variant as a callable running one step, set up once (plans, exports, compilation)."""

    def __init__(self, layers: int):
        import torch

        from slackswap.experiment.export_plan import plan_for_export
        from slackswap.planners.registry import get_planner
        from slackswap.runtime import apply, capture_graph
        from slackswap.runtime.copy_engines import CpuCopies
        from slackswap.runtime.export import PlanExport, recording_backend
        from slackswap.runtime.training_workload import build_training_workload, small_config
        from slackswap.simulate.metrics import simulate_ideal
        from tests.runtime_support import h200

        self.torch = torch
        self.w = build_training_workload(*small_config("tiny", layers=layers, **SHAPE))
        w = self.w
        self.graph = capture_graph(w.model, (w.batch,), w.loss_fn, h200(), f"tiny-{layers}l")
        keep_all_peak = simulate_ideal(self.graph, h200()).peak_activation_bytes
        self.plans = {
            "keep_all": get_planner("keep_all").plan(self.graph, h200(), None),
            "slackswap": get_planner("slackswap").plan(self.graph, h200(), int(keep_all_peak * BUDGET_FRACTION)),
        }
        # Attribution only: slackswap's plan with every swap that hides left in (`only_needed_swaps:
        # false`, the plans before slackswap dropped the swaps its budget does not need): the runtime's
        # cost on the plan with the most transfers.
        self.plans["every_hidden_swap"] = get_planner("slackswap", only_needed_swaps=False).plan(
            self.graph, h200(), int(keep_all_peak * BUDGET_FRACTION))
        self.runs = {k: apply(p, self.graph, w.model) for k, p in self.plans.items()}
        # Attribution only: the same plan with the CPU stand-in copies timed (`CpuCopies(measure=True)`,
        # two clock reads per copy, so not in the timed runtime_slackswap row).
        self.runs["measured_copies"] = apply(self.plans["slackswap"], self.graph, w.model,
                                             copies=CpuCopies(measure=True))
        # Attribution only: the slackswap plan with a copy engine that moves no data (an "offload"
        # holds the device storage itself, a "prefetch" hands it back): the runtime's own cost.
        self.runs["no_data"] = apply(self.plans["slackswap"], self.graph, w.model, copies=NoDataCopies())
        # The export runs slackswap's plan made for it (`plan_for_export`: the tensors PyTorch keeps
        # whatever a plan says are kept, one decision per op), so it executes every decision as planned.
        # Timed at the benchmark's budget as slackswap plans it: PyTorch's eager replay of that plan peaks
        # above the budget (plan_for_export refuses it by default since issue 39), so the fit is off here.
        self.plans["export"] = plan_for_export(get_planner("slackswap"), self.graph, w.model, h200(),
                                               int(keep_all_peak * BUDGET_FRACTION), fit_pytorch_placement=False)
        # The compiled row runs the plan made for the compiled export (the same budget), priced on the graph
        # as the compiled step stores it (each layer's dropout mask bool, `export_plan_graph`).
        self.plans["export_compiled"] = plan_for_export(get_planner("slackswap"), self.graph, w.model, h200(),
                                                        int(keep_all_peak * BUDGET_FRACTION), compile=True,
                                                        fit_pytorch_placement=False)
        self.export = PlanExport(self.plans["export"], self.graph, w.model)
        self.compiled_export = PlanExport(self.plans["export_compiled"], self.graph, w.model)
        #: The graph each plan was made on (the captured one unless named here): an export's own.
        self.plan_graphs = {"export": self.export.graph, "export_compiled": self.compiled_export.graph}
        self.backend, self.partitions = recording_backend()
        self.layers = [w.model.get_submodule(p) for p in self.export.regions]
        #: Per timed runtime_slackswap step: CPU seconds of its inline copies (`CpuCopies.copy_s`).
        self.copy_s: list[float] = []

    # ------------------------------------------------------------------ one step per variant
    def eager(self) -> None:
        _step(self.w)

    def checkpoint(self) -> None:
        from torch.utils.checkpoint import checkpoint

        originals = [layer.forward for layer in self.layers]
        try:
            for layer, f in zip(self.layers, originals, strict=True):
                layer.forward = lambda *a, f=f: checkpoint(f, *a, use_reentrant=False)
            _step(self.w)
        finally:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)

    def save_on_cpu(self) -> None:
        with self.torch.autograd.graph.save_on_cpu():
            _step(self.w)

    def offload_hooks(self) -> None:
        torch = self.torch
        params = {id(p) for p in self.w.model.parameters()}

        def pack(t):
            if id(t) in params or t.untyped_storage().nbytes() < MIN_OFFLOAD_BYTES:
                return t
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            host.copy_(t)
            return (host, t.device)

        def unpack(packed):
            if isinstance(packed, tuple):
                host, device = packed
                return host if device.type == "cpu" else host.to(device, non_blocking=True)
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            _step(self.w)

    def runtime_keep_all(self) -> None:
        with self.runs["keep_all"]:
            _step(self.w)

    def runtime_slackswap(self) -> None:
        with self.runs["slackswap"]:
            _step(self.w)

    def runtime_slackswap_measured_copies(self) -> None:
        copies = self.runs["measured_copies"].copies
        before = copies.copy_s
        with self.runs["measured_copies"]:
            _step(self.w)
        self.copy_s.append(copies.copy_s - before)

    def runtime_slackswap_no_data(self) -> None:
        with self.runs["no_data"]:
            _step(self.w)

    def runtime_every_hidden_swap(self) -> None:
        with self.runs["every_hidden_swap"]:
            _step(self.w)

    def identity_hooks(self) -> None:
        """Saved-tensor hooks that return their argument: what autograd's calls into Python cost per
        saved tensor, before any hook does anything (the floor of every hook-based runtime)."""
        with self.torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            _step(self.w)

    def same_copies_plain_hooks(self) -> None:
        """The slackswap plan's copies by the simplest hooks: at the pack, copied into a host buffer made
        once; at the unpack, cloned back (the saved tensors in the verified step's order)."""
        with self.torch.autograd.graph.saved_tensors_hooks(*self._plain_hooks()):
            _step(self.w)

    def unchecked_program(self) -> None:
        """The runtime's own hook program for the slackswap plan (`PlanRun`'s `HookProgram`: offloads at
        the packs that hand their tensors over, prefetches at the unpacks the plan's positions put them
        at, each read from the copy the program names), run by hooks that check nothing and call the
        copies inline: what executing the plan's schedule costs before any check or engine layer."""
        with self.torch.autograd.graph.saved_tensors_hooks(*self._unchecked_hooks()):
            _step(self.w)

    def _unchecked_hooks(self) -> tuple:
        from slackswap.runtime.eager.views import _read, _whole

        packs, unpacks, buffers = self._unchecked_packs, self._unchecked_unpacks, self._unchecked_host
        count, hosts, held = [0, 0], {}, {}

        def pack(t):
            k = count[0]
            count[0] = k + 1
            offloads, by_number, whole = packs[k][:3]
            if offloads:
                copy = t if whole else _whole(t)
                for j in offloads:
                    host = buffers.get(j)
                    if host is None:
                        host = buffers[j] = self.torch.empty_like(copy)
                    hosts[j] = host.copy_(copy)
            return k if by_number else t

        def unpack(packed):
            u = count[1]
            count[1] = u + 1
            prefetches, c, release = unpacks[u]
            for offload, last, made in prefetches:
                held[made] = (hosts.pop(offload) if last else hosts[offload]).clone()
            if type(packed) is not int:
                return packed
            copy = held.pop(c) if release else held[c]
            whole, geometry = packs[packed][2:]
            return copy if whole else _read(copy, *geometry)

        return pack, unpack

    def _prepare_attribution(self) -> str | None:
        """After the runtime's verified step: the tables the plain and the unchecked hooks read. Returns
        why the unchecked hooks cannot run the program (None: they can)."""
        self._swapped_packs = [r.name is not None and str(r.decision) == "swap"
                               for r in self.runs["slackswap"].recording.packs]
        self._plain_host: dict[int, object] = {}
        return self._unchecked_program_refusal()

    def _unchecked_program_refusal(self) -> str | None:
        """Why the unchecked hooks cannot run this program (they handle offloads at packs and
        prefetches at unpacks, nothing else), or None; on None their tables are set."""
        program = self.runs["slackswap"]._program
        if program.tail or any(p.ops or p.held or p.reads_rng for p in program.packs):
            return "the program has operations at a pack or after the last event"
        if any(u.ops for u in program.unpacks):  # prefetches alone are carried apart (`UnpackEvent.prefetches`)
            return "the program has operations other than prefetches at an unpack"
        self._unchecked_packs = [(p.offloads, p.by_number, p.whole, (p.dtype, p.shape, p.stride, p.offset))
                                 for p in program.packs]
        self._unchecked_unpacks = [(u.prefetches, u.copy, u.release) for u in program.unpacks]
        self._unchecked_host: dict[int, object] = {}
        return None

    def _plain_hooks(self) -> tuple:
        torch, swapped, buffers = self.torch, self._swapped_packs, self._plain_host
        count = [0]

        def pack(t):
            k = count[0]
            count[0] = k + 1
            if not swapped[k]:
                return t
            host = buffers.get(k)
            if host is None:
                host = buffers[k] = torch.empty_like(t)
            host.copy_(t)
            return (host,)

        def unpack(packed):
            return packed[0].clone() if type(packed) is tuple else packed

        return pack, unpack

    def _seconds_in_hooks(self, steps: int) -> tuple[float, float]:
        """Per step, the least over `steps` steps of the seconds spent inside the saved-tensor hooks
        (`time.perf_counter` around each call; one core, so wall time is CPU time): of the runtime
        under the slackswap plan, and of the plain hooks making the same copies. Where the gap
        between the two rows is: in the hooks' own code, or around them."""
        pc, spent = time.perf_counter, [0.0]

        def timed(hook):
            def wrapper(x):
                t0 = pc()
                out = hook(x)
                spent[0] += pc() - t0
                return out
            return wrapper

        run = self.runs["slackswap"]
        step_hooks = run._step_hooks

        def timed_step_hooks():
            pack, unpack, reached = step_hooks()
            return timed(pack), timed(unpack), reached

        run._step_hooks = timed_step_hooks
        plain = []
        try:
            for _ in range(steps):
                spent[0] = 0.0
                self._one("runtime_slackswap")
                runtime = spent[0]
                spent[0] = 0.0
                self.torch.manual_seed(1)
                _zero(self.w)
                with self.torch.autograd.graph.saved_tensors_hooks(*map(timed, self._plain_hooks())):
                    _step(self.w)
                plain.append((runtime, spent[0]))
        finally:
            del run._step_hooks  # back to the method
        return min(r for r, _ in plain), min(p for _, p in plain)

    def export_eager(self) -> None:
        with self.export.installed(self.w.model):
            _step(self.w)

    def export_compiled(self) -> None:
        # Compiled once, in the first call (the warm-up); later installations reuse the code.
        with self.compiled_export.installed(self.w.model, compile=True, backend=self.backend):
            _step(self.w)

    # ------------------------------------------------------------------ figures
    def run(self, rounds: int) -> list[dict]:
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        calls, peaks = {}, {}
        for v in VARIANTS:  # warm-up: the runtime's verified step, caches
            self._one(v)
        attribution = ("runtime_slackswap_no_data", "same_copies_plain_hooks", "identity_hooks",
                       "runtime_every_hidden_swap")
        unchecked_refusal = self._prepare_attribution()
        if unchecked_refusal is None:
            attribution += ("unchecked_program",)
        for v in (*attribution, "runtime_slackswap_measured_copies"):
            self._one(v)
        self.copy_s.clear()
        extra: dict[str, list[float]] = {v: [] for v in attribution}
        for _ in range(rounds):
            for v in VARIANTS:
                times[v].append(self._one(v))
            for v in attribution:
                extra[v].append(self._one(v))
            self._one("runtime_slackswap_measured_copies")
        for v in VARIANTS:
            calls[v] = None if v == "export_compiled" else self._count_calls(v)
            peaks[v] = self._peak(v)
        eager = min(times["eager"])

        def paired(per_round: list[float]) -> float:
            return paired_ratio(per_round, times["eager"])

        rows = []
        for v in VARIANTS:
            cpu = min(times[v])
            ratio = paired(times[v])
            row = {"variant": v, "layers": len(self.layers), "cpu_s_per_step": cpu,
                   "cpu_s_per_step_median": statistics.median(times[v]), "aten_calls": calls[v],
                   "ratio_to_eager": ratio, "ratio_to_eager_of_minima": cpu / eager,
                   "peak_bytes": peaks[v], "planned_saved_bytes": None, "rounds": rounds}
            plan = {"runtime_keep_all": "keep_all", "export_compiled": "export_compiled"}.get(
                v, "slackswap" if v.startswith("runtime") else "export" if v.startswith("export") else None)
            if plan is not None:
                row["planned_saved_bytes"] = self._kept_bytes(plan)
                row["plan_offloads"] = len(self.plans[plan].offloads)
                row["plan_recompute_steps"] = sum(1 for x in self.plans[plan].steps if str(x.kind) == "recompute")
            if v in ("runtime_keep_all", "runtime_slackswap"):
                # The runtime's CPU cost over eager per ATen call of the plain step and per saved tensor
                # (pack and unpack): against the GPU time per call, what says whether a GPU stays busy.
                run = self.runs["keep_all" if v == "runtime_keep_all" else "slackswap"]
                row["saved_tensors"] = len(run.recording.packs)
                row["overhead_s_per_aten_call"] = (ratio - 1) * eager / calls["eager"]
                row["overhead_s_per_saved_tensor"] = (ratio - 1) * eager / len(run.recording.packs)
            if v == "runtime_slackswap":
                copy = min(self.copy_s)
                row["copy_cpu_s_per_step"] = copy
                row["ratio_to_eager_without_copies"] = ratio - copy / eager
                row["cpu_s_per_step_no_data_copies"] = min(extra["runtime_slackswap_no_data"])
                row["ratio_to_eager_no_data_copies"] = paired(extra["runtime_slackswap_no_data"])
                row["ratio_to_eager_same_copies_plain_hooks"] = paired(extra["same_copies_plain_hooks"])
                row["ratio_to_eager_identity_hooks"] = paired(extra["identity_hooks"])
                row["ratio_to_eager_unchecked_program"] = (
                    paired(extra["unchecked_program"]) if unchecked_refusal is None else None)
                row["unchecked_program_refusal"] = unchecked_refusal
                row["ratio_to_eager_every_hidden_swap"] = paired(extra["runtime_every_hidden_swap"])
                row["plan_offloads_every_hidden_swap"] = len(self.plans["every_hidden_swap"].offloads)
                row["planned_saved_bytes_every_hidden_swap"] = self._kept_bytes("every_hidden_swap")
                row["hooks_s_per_step"], row["plain_hooks_s_per_step"] = self._seconds_in_hooks(rounds)
            if v == "export_eager":
                row.update(self._eager_saved())
            if v == "export_compiled":
                row.update(self._compiled_saved())
            rows.append(row)
        return rows

    def _plan_accounting(self, key: str = "export") -> dict:
        """The plan made for the export (`key`: for eager, "export"; for compile, "export_compiled") against
        slackswap's plan of the same budget (what fitting PyTorch's plan space costs, simulated on the H200
        preset, each on the graph it was made on), and the bytes it keeps and swaps."""
        from slackswap.simulate import simulate
        from tests.runtime_support import h200

        plan, graph = self.plans[key], self.plan_graphs.get(key, self.graph)
        sizes = graph.tensors
        return {"planned_offloaded_bytes": sum(sizes[n].size_bytes for n, d in plan.decisions.items()
                                               if str(d) == "swap"),
                "plan_fixed_keep": plan.notes["fixed_keep"], "plan_fixed_keep_bytes": plan.notes["fixed_keep_bytes"],
                "sim_step_s_plan_for_export": simulate(graph, plan, h200(), None).step_s,
                "sim_step_s_slackswap_plan": simulate(self.graph, self.plans["slackswap"], h200(), None).step_s}

    def _eager_saved(self) -> dict:
        """One extra eager export step inside `counting_saved`: the device bytes of every storage it saves
        for backward (checkpoint caches and autograd's), against the plan's kept bytes."""
        torch, export, model = self.torch, self.export, self.w.model
        torch.manual_seed(1)
        _zero(self.w)
        with export.counting_saved(model) as count, export.installed(model):
            _step(self.w)
        saved = export.saved_activation_bytes(count)
        planned = self._kept_bytes("export")
        return {"export_saved_bytes": saved, "export_offloaded_bytes": export.record.offloaded_bytes,
                "export_differences": len(export.step_differences()),
                "export_saved_equals_planned": saved == planned, **self._plan_accounting()}

    def _compiled_saved(self) -> dict:
        """The compiled partitions' device bytes (activations, each layer of a compile group counted)
        plus what autograd holds outside them whatever the policy (tensors outside every layer, the layers'
        outputs, `ExportFacts.fixed_keep`, and the layer inputs the checkpoints hold, `held_inputs`: kept by
        the plan), against the plan's kept bytes; the values the plan does not name (inside ops'
        decompositions) and the planned tensors the partition lacks."""
        from slackswap.runtime.export import (
            LAYER_OUTPUT,
            OUTSIDE,
            differences_by_reason,
            partition_differences,
            saved_bytes,
        )
        from slackswap.runtime.export_facts import module_path, region_of

        export, plan = self.compiled_export, self.plans["export_compiled"]
        sizes = export.graph.tensors  # the graph the plan was made on: dropout masks at their compiled bytes
        decisions = plan.decisions
        device, host = saved_bytes(self.partitions, export)
        unplanned, _ = saved_bytes(self.partitions, export, lambda v: v.plan_tensor not in decisions)
        saved = {v.plan_tensor for part in self.partitions for v in part if not v.is_input}
        regions = {n: region_of(module_path(n), export.regions) for n in export.facts().fixed_keep}
        held = sum(sizes[n].size_bytes for n, why in export.facts().fixed_keep.items()
                   if why in (OUTSIDE, LAYER_OUTPUT)  # held by autograd unless the partition saves it
                   and (regions[n] is None or export.translate(n, regions[n]) not in saved))
        held += sum(sizes[n].size_bytes for n in export.facts().held_inputs)  # inputs of the compiled layers
        differences = export.static_differences() + partition_differences(export, self.partitions)
        planned = self._kept_bytes("export_compiled")
        accounting = self._plan_accounting("export_compiled")
        # The dropout masks inside the layers, as this plan prices them (bool under compile) and as the
        # eager plan prices CPU eager's fp32 noise.
        masks = [n for r in range(len(export.regions)) for ds in export.eager_dropouts(r).values() for _, n in ds]
        return {"export_saved_bytes": device + held, "export_partition_saved_bytes": device,
                "export_held_outside_partition_bytes": held, "export_offloaded_bytes": host,
                "export_saved_unplanned_bytes": unplanned,
                "export_saved_minus_planned_bytes": device + held - planned,
                "export_offloaded_equals_planned": host == accounting["planned_offloaded_bytes"],
                "export_dropout_mask_planned_bytes": sum(sizes[n].size_bytes for n in masks),
                "export_dropout_noise_eager_bytes": sum(self.graph.tensors[n].size_bytes for n in masks),
                "export_saved_equals_planned": device + held == planned,
                "compiled_layer_groups": len(set(export.group_of.values())),
                "export_differences": len(differences),
                "export_differences_by_reason": differences_by_reason(differences),
                **accounting}

    def _kept_bytes(self, key: str) -> int:
        """Device bytes the plan `key` keeps, priced on the graph it was made on."""
        sizes = self.plan_graphs.get(key, self.graph).tensors
        return sum(sizes[n].size_bytes for n, d in self.plans[key].decisions.items() if str(d) == "keep")

    def _one(self, v: str) -> float:
        torch = self.torch
        torch.manual_seed(1)
        _zero(self.w)
        t0 = time.process_time()
        getattr(self, v)()
        return time.process_time() - t0

    def _count_calls(self, v: str) -> int:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Count(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Count.n += 1
                return func(*args, **(kwargs or {}))

        self.torch.manual_seed(1)
        _zero(self.w)
        with Count():
            getattr(self, v)()
        return Count.n

    def _peak(self, v: str) -> int:
        self.torch.manual_seed(1)
        _zero(self.w)
        return peak_cpu_bytes(getattr(self, v))


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
