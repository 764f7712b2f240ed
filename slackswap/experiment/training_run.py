"""One training run of a torch preset under a plan: the library side of `python -m pipelines.train`.

    spec = TrainingRunSpec.from_dict(config)   # every check, ConfigError naming field and value
    outcome = run_training(spec, progress)     # build, capture, plan, simulate, check, N steps
    outcome.verdict, outcome.figures           # figures: train.json key for key (docs/runtime.md)

The run: build the preset's torch model on the device, capture the graph of one real step, plan it
with the chosen planner and budget, simulate the plan on the chosen hardware (and on this device's
own link, what the measured peak is compared with), check that the plan's loss and gradients equal
a plain step's, then run N AdamW steps under it. With `executor="compile"` the plan runs as PyTorch
selective checkpointing, each layer compiled (`_run_compiled`); with `executor="export"` the plan made
for the export runs as eager per-layer selective checkpointing (`_run_export`); with `executor="auto"`
under the runtime unless the runtime's hook-only program refuses it (a plan that keeps or recomputes a
tensor autograd does not save runs every step verified, under dispatch modes: that step times the
verifier, not the plan), and then through the eager export (`slackswap.experiment.measured_executor`).
The steps themselves are `slackswap.runtime.train`; this module orders them and collects the
figures. The caller adds Hydra, MLflow, the console lines (through `TrainingProgress`) and the
versions it writes beside the figures.

Imports torch only inside `run_training` (and `from_dict` for `device="cuda"`), so the experiment
layer imports without the torch extra.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slackswap import validation as check
from slackswap.budget import Budget
from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.experiment.measured_prediction import export_block_shape
from slackswap.experiment.measured_timing import MeasuredTiming, PlainDrift
from slackswap.experiment.run import Verdict
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.parallel import NO_PARALLELISM, ParallelConfig
from slackswap.plan import Plan
from slackswap.planners.base import Planner
from slackswap.profile.host_allocator import host_allocator
from slackswap.profile.torch.spec import TorchSpec
from slackswap.simulate.result import SimResult

if TYPE_CHECKING:
    from slackswap.experiment.measured_executor import ExportCheck
    from slackswap.runtime.train import CompiledGradCheck, GradCheck, StepRecord
    from slackswap.runtime.training_workload import Workload

DEVICES = ("cpu", "cuda")
#: eager: `slackswap.runtime.apply`; compile: the plan's export, torch.compile'd; export: the plan made for
#: the export as eager selective checkpointing; auto: eager unless the hook-only program refuses the plan,
#: then export.
EXECUTORS = ("eager", "compile", "export", "auto")


@dataclass(frozen=True)
class TrainingRunSpec:
    """Every input of one training run, checked before any work (`from_dict`)."""

    model: ModelConfig
    torch_spec: TorchSpec
    #: The simulated hardware (the plan is made for it; on the CPU the measured step is compared with
    #: the same plan on an instant link).
    hardware: Hardware
    budget: Budget
    planner_name: str
    planner_options: Mapping[str, Any]
    #: "cpu" or "cuda".
    device: str
    #: One of `EXECUTORS`.
    executor: str
    steps: int
    #: Weights, batches and dropout stream; the gradient check uses `seed + 1`.
    seed: int
    lr: float
    #: The planner, built once from `planner_name` and `planner_options`.
    planner: Planner | None = field(default=None, compare=False, repr=False)
    #: `profile.timing` and its settings: measured op times replace the roofline's before planning.
    timing: MeasuredTiming = field(default_factory=MeasuredTiming)
    #: Keep the host allocator's freed memory in the process from the run's start
    #: (`slackswap.profile.host_allocator.keep_freed_memory`); False: the C library's own behaviour.
    keep_freed_host_memory: bool = True

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> TrainingRunSpec:
        """The checks of a training run from a resolved config's `model`, `hardware`, `budget`,
        `planner` and `train` nodes. Raises `ConfigError` naming the field and its value."""
        from slackswap.planners.registry import get_planner

        model_node = dict(config["model"])
        torch_node = model_node.pop("torch", None)
        if not torch_node:
            raise ConfigError("model.torch", None, "a training run needs a torch preset (hf_*, tiny_torch, hf_gpt2_2l)")
        train = config["train"]
        if train["device"] not in DEVICES:
            raise ConfigError("train.device", train["device"], f"unknown device; known: {DEVICES}")
        if train["executor"] not in EXECUTORS:
            raise ConfigError("train.executor", train["executor"], f"unknown executor; known: {EXECUTORS}")
        check.integer("train.steps", train["steps"], 1)
        check.integer("train.seed", train["seed"])
        keep_freed = check.flag("train.keep_freed_host_memory", train["keep_freed_host_memory"])
        lr = check.positive("train.lr", train["lr"])
        if train["device"] == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("train.device", "cuda", "no CUDA device is visible to this torch build")
        hardware = Hardware.from_dict(config["hardware"])
        model = ModelConfig.from_dict(model_node)
        parallel = ParallelConfig.from_dict(config.get("parallel"))
        if parallel != NO_PARALLELISM:  # never silently ignored
            raise ConfigError("parallel", parallel.as_dict(),
                              "a training run executes one full replica on one device; leave parallel at none")
        torch_spec = TorchSpec.from_dict(torch_node)
        budget = Budget.from_dict(config["budget"])
        planner = config["planner"]
        options = dict(planner.get("options") or {})
        return cls(
            model=model, torch_spec=torch_spec, hardware=hardware, budget=budget, planner_name=planner["name"],
            planner_options=options, device=train["device"], executor=train["executor"], steps=train["steps"],
            seed=train["seed"], lr=float(lr),
            # Unknown planner names and options fail here, before anything runs or is recorded.
            planner=get_planner(planner["name"], **options),
            timing=MeasuredTiming.from_dict(config.get("profile")),
            keep_freed_host_memory=keep_freed,
        )


class TrainingProgress:
    """What a training run reports as it goes, one method per moment; here each does nothing. The
    pipeline overrides them to print its console lines."""

    def building(self, spec: TrainingRunSpec) -> None:
        """About to build the model on the device."""

    def host_allocator(self, detail: str) -> None:
        """How the host allocator runs (`spec.keep_freed_host_memory`, set before the model is built)."""

    def captured(self, graph: Graph, capture_s: float, keep_all_peak_bytes: int, budget_bytes: int | None) -> None:
        """The step's graph is captured and the budget resolved against its keep-all peak."""

    def infeasible(self, reason: str) -> None:
        """The planner found no plan within the budget; the run ends here."""

    def checked(self, counts: Mapping[str, int], check: GradCheck) -> None:
        """The eager gradient check ran (`counts`: the plan's recomputes, offloads and prefetches)."""

    def compiled_checked(self, check: CompiledGradCheck) -> None:
        """The compiled gradient check ran (the export is compiled and reused by the steps)."""

    def refused(self, reason: str) -> None:
        """executor=auto: the runtime's hook-only program refuses the plan; the eager export runs it."""

    def export_checked(self, check: ExportCheck) -> None:
        """The eager export's gradient check ran (executor=export, or auto after a refusal)."""

    def step(self, record: StepRecord) -> None:
        """One optimizer step under the plan finished."""

    def timed(self, figures: Mapping[str, Any]) -> None:
        """profile.timing=measured: the graph's ops were timed on the device (how many by each source), and
        the op-time table and the machine description were each reused from the cache or measured
        (`op_times_cache_line`, `machine_cache_line`)."""


@dataclass(frozen=True)
class TrainingRunOutcome:
    """What one training run produced."""

    verdict: Verdict
    #: Empty for OK; the planner's reason for INFEASIBLE.
    reason: str
    #: The figures, key for key what train.json holds (without the caller's `versions`); MLflow logs
    #: the scalars among them.
    figures: Mapping[str, Any]
    graph: Graph
    budget_bytes: int | None
    plan: Plan | None = None
    #: The plan simulated on `spec.hardware` under the budget, and on this device's own link without one.
    simulation: SimResult | None = None
    simulation_device_link: SimResult | None = None
    records: tuple[StepRecord, ...] = ()


def run_training(spec: TrainingRunSpec, progress: TrainingProgress | None = None) -> TrainingRunOutcome:
    """Run `spec` (module docstring) and return its outcome. An infeasible budget is an outcome; any
    other failure raises."""
    from slackswap.experiment.export_plan import export_plan_graph, plan_for_export
    from slackswap.runtime import capture_graph, plan_counts
    from slackswap.runtime.training_workload import build_training_workload
    from slackswap.simulate import simulate
    from slackswap.simulate.metrics import simulate_ideal
    from slackswap.simulate.saved_peak import instant_link, simulated_saved_peak_bytes

    progress = progress or TrainingProgress()
    hardware = spec.hardware
    allocator = host_allocator(spec.keep_freed_host_memory)  # before the model's first tensor
    progress.building(spec)
    progress.host_allocator(allocator)
    w = build_training_workload(spec.model, spec.torch_spec, spec.device, spec.seed)
    t0 = time.perf_counter()
    graph = capture_graph(w.model, w.inputs, w.loss_fn, hardware, f"{spec.model.name}@{hardware.name}")
    capture_s = time.perf_counter() - t0
    ideal = simulate_ideal(graph, hardware)
    budget_bytes = spec.budget.resolve_bytes(ideal.peak_activation_bytes)
    progress.captured(graph, capture_s, ideal.peak_activation_bytes, budget_bytes)
    figures: dict[str, Any] = {"status": Verdict.OK, "capture_s": capture_s, "budget_bytes": budget_bytes,
                               "keep_all_peak_bytes": ideal.peak_activation_bytes, "timing": spec.timing.timing,
                               "host_allocator": allocator}
    machine = costs = eager_check = None
    if spec.timing.measured:  # the planner and the simulator see the measured op times
        graph, timed, costs = spec.timing.retime(graph, w, hardware, export_block_shape(spec.model))
        machine, links = spec.timing.machine(spec.device)
        timed |= links
        figures.update(timed)
        progress.timed(timed)
    if spec.executor == "compile":
        # Planned and simulated as the compiled export stores the step (each layer's dropout mask bool); the
        # budget stays resolved against the captured step's keep-all peak, the same bytes for both executors.
        graph = export_plan_graph(graph, w.model, compile=True)
    executor = "eager" if spec.executor == "auto" else spec.executor
    try:
        if executor in ("compile", "export"):  # inside PyTorch's plan space: the export runs it as planned
            plan = plan_for_export(spec.planner, graph, w.model, hardware, budget_bytes, compile=executor == "compile")
        else:
            plan = spec.planner.plan(graph, hardware, budget_bytes)
        if spec.executor == "auto":
            from slackswap.runtime.train import gradient_check

            # The eager executor's own gradient check, made once: its verified step is what says whether
            # the hook-only program refuses the plan, and `_run_eager` reuses it (the same weights, batch,
            # seed and plan would check the same step again).
            eager_check = gradient_check(w, graph, plan, seed=spec.seed + 1)
            figures["hook_only_refusal"] = refusal = eager_check.report.hook_only_refusal
            if refusal is not None:
                progress.refused(refusal)
                executor = "export"
                plan = plan_for_export(spec.planner, graph, w.model, hardware, budget_bytes)
        figures["executor"] = executor
    except InfeasibleBudgetError as exc:
        figures.update(status=Verdict.INFEASIBLE, infeasible_reason=str(exc))
        progress.infeasible(str(exc))
        return TrainingRunOutcome(Verdict.INFEASIBLE, str(exc), figures, graph, budget_bytes)
    sim = simulate(graph, plan, hardware, budget_bytes)
    # What the measured peak is compared with: the same plan on this device's link. On the CPU a copy
    # has arrived when it is issued (an instant link), so offloaded copies free earlier than on the
    # simulated hardware's link; on CUDA the hardware's own link.
    on_link = simulate(graph, plan, instant_link(hardware) if spec.device == "cpu" else hardware, None)
    counts = plan_counts(plan)
    if not sim.feasible:  # the plan over its budget on the simulated hardware: said, never a crash later
        figures["sim_infeasible_reason"] = sim.infeasible_reason
    figures.update(sim_step_s=sim.step_s, sim_peak_activation_bytes=sim.peak_activation_bytes,
                   sim_peak_activation_bytes_device_link=on_link.peak_activation_bytes,
                   sim_saved_peak_bytes=simulated_saved_peak_bytes(graph, plan, hardware),
                   sim_saved_peak_bytes_link=simulated_saved_peak_bytes(graph, plan, hardware, instant=False),
                   **{f"plan_{k}": v for k, v in counts.items()})
    # The plain step timed right before the plan's steps and again right after (same count, same way):
    # how far the machine itself moved while the prediction's steps ran.
    plain_before = spec.timing.plain_steps(w, spec.steps) if machine is not None and executor != "compile" else None
    if executor == "compile":
        records = _run_compiled(spec, w, graph, plan, figures, progress)
    elif executor == "export":
        records = _run_export(spec, w, graph, plan, figures, progress)
        if machine is not None and figures["grad_check_bit_exact"]:  # as eager checkpointing runs the plan
            figures.update(spec.timing.compare(graph, plan, hardware, machine, figures["step_times_s"], costs,
                                               export=True, model=w.model))
    else:
        records = _run_eager(spec, w, graph, plan, counts, figures, progress, eager_check)
        if machine is not None:  # the plan's predicted step on this machine beside its measured steps
            figures.update(spec.timing.compare(graph, plan, hardware, machine, figures["step_times_s"], costs))
        if spec.device == "cpu":
            # The CPU ledger counts the graph's tensors, as the simulator does; on CUDA the measured peak
            # is max_memory_allocated (weights and optimizer state too) and is not compared byte for byte.
            figures.update(
                measured_equals_sim=figures["measured_peak_bytes"] == on_link.peak_activation_bytes,
                measured_within_budget=budget_bytes is None or figures["measured_peak_bytes"] <= budget_bytes,
            )
    if plain_before is not None and "step_relative_error" in figures:  # beside the error, never in it
        drift = PlainDrift.of(plain_before, spec.timing.plain_steps(w, spec.steps))
        figures.update(drift.figures())
        figures.update(spec.timing.paired(graph, hardware, machine, figures, drift))
    return TrainingRunOutcome(Verdict.OK, "", figures, graph, budget_bytes, plan, sim, on_link, tuple(records))


def _run_eager(spec: TrainingRunSpec, w: Workload, graph: Graph, plan: Plan, counts: Mapping[str, int],
               figures: dict[str, Any], progress: TrainingProgress, check: GradCheck | None = None) -> list[StepRecord]:
    """executor=eager: the bit-exact gradient check under `apply` (with the ledger's account of its
    peak; `check`: that check already made, by executor=auto asking whether the hook-only program
    refuses the plan), then the steps, each with its ledger and measured peak. The first step runs
    verified again on purpose: on a fresh batch, it records the program the hook-only steps run and is
    the step whose ledger gives the CPU's measured peak."""
    from slackswap.runtime.compare import explain_ledger
    from slackswap.runtime.train import gradient_check, train_steps

    if check is None:
        check = gradient_check(w, graph, plan, seed=spec.seed + 1)
    why = explain_ledger(graph, plan, check.report.live_by_step)
    figures.update(grad_check_bit_exact=check.bit_exact, grad_check_max_abs_diff=check.max_abs_diff,
                   check_ledger_peak_bytes=check.report.ledger_peak_bytes,
                   ledger_plan_bytes_at_peak=why["plan_bytes_at_ledger_peak"],
                   ledger_late_bytes=why["late_bytes"], ledger_missing_copies=len(why["missing"]),
                   ledger_late_tensors=[name for name, _, _ in why["late"]])
    progress.checked(counts, check)
    records = train_steps(w, graph, plan, spec.steps, spec.lr, spec.seed, progress.step)
    last = records[-1].report
    figures.update(
        measured_step_s=_median_step_s(records),
        measured_peak_bytes=max(r.measured_peak_bytes for r in records),
        ledger_peak_bytes=max(r.ledger_peak_bytes for r in records),
        runtime_recompute_steps=last.recompute_steps, runtime_offloads=last.offloads,
        runtime_prefetches=last.prefetches, late_prefetch_waits=sum(r.report.late_prefetch_waits for r in records),
        losses=[r.loss for r in records], step_times_s=[r.step_s for r in records],
        counts_equal_plan=(last.recompute_steps, last.offloads, last.prefetches)
        == (counts["recompute_steps"], counts["offloads"], counts["prefetches"]),
    )
    return records


def _run_compiled(spec: TrainingRunSpec, w: Workload, graph: Graph, plan: Plan, figures: dict[str, Any],
                  progress: TrainingProgress) -> list[StepRecord]:
    """executor=compile: the plan as selective checkpointing, each layer torch.compile'd. The one place
    this module reaches the export (`slackswap.runtime.export`, through the check and the steps). No
    ledger (nothing of slackswap runs inside the step); the export's differences from the plan are
    listed instead, and the gradient check reports the largest difference (compiled kernels and
    inductor's random numbers are not eager's, so bit equality is not expected)."""
    from slackswap.runtime.export import differences_by_reason
    from slackswap.runtime.train import compiled_gradient_check, train_steps

    check = compiled_gradient_check(w, graph, plan, seed=spec.seed + 1)
    figures.update(grad_check_bit_exact=check.bit_exact, grad_check_max_abs_diff=check.max_abs_diff,
                   export_differences=len(check.differences),
                   # Decisions the export cannot execute as planned whatever the compiler does: none for
                   # a plan made for the export; the rest are the compiled partition's own.
                   export_static_differences=len(check.export.static_differences()),
                   export_difference_tensors=[d.tensor for d in check.differences],
                   # By the reason's first clause: for a plan made for the compiled export only the layers'
                   # outputs (held by autograd outside the partition), no dropout mask saved in another form.
                   export_differences_by_reason=differences_by_reason(check.differences))
    progress.compiled_checked(check)
    records = train_steps(w, graph, plan, spec.steps, spec.lr, spec.seed, progress.step, executor="compile",
                          export=check.export, backend=check.backend)  # compiled once, in the check
    figures.update(measured_step_s=_median_step_s(records), losses=[r.loss for r in records],
                   step_times_s=[r.step_s for r in records])
    if w.batch.device.type == "cuda":
        figures["measured_peak_bytes"] = max(r.measured_peak_bytes for r in records)
    return records


def _run_export(spec: TrainingRunSpec, w: Workload, graph: Graph, plan: Plan, figures: dict[str, Any],
                progress: TrainingProgress) -> list[StepRecord]:
    """executor=export (or auto after a refusal): the plan made for the export as eager per-layer selective
    checkpointing. Its loss and gradients are checked bit for bit against a plain step's from the same
    RNG seed; the prediction is compared with the steps only when they are equal. No ledger (PyTorch's
    checkpointing runs the step)."""
    from slackswap.experiment.measured_executor import export_gradient_check, export_steps

    check = export_gradient_check(w, graph, plan, spec.seed + 1)
    figures.update(grad_check_bit_exact=check.bit_exact, grad_check_max_abs_diff=check.max_abs_diff,
                   export_differences=check.differences)
    progress.export_checked(check)
    records = export_steps(w, graph, plan, spec.steps, spec.lr, spec.seed, on_step=progress.step)
    figures.update(measured_step_s=_median_step_s(records), losses=[r.loss for r in records],
                   step_times_s=[r.step_s for r in records])
    if w.batch.device.type == "cuda":
        figures["measured_peak_bytes"] = max(r.measured_peak_bytes for r in records)
    return records


def _median_step_s(records: list[StepRecord]) -> float:
    """The median step time, without the first step (warm-up: allocator, kernels, compilation) when
    there is more than one."""
    return statistics.median([r.step_s for r in records[1:]] or [records[0].step_s])
