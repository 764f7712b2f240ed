"""Real optimizer steps under a plan, the gradient check, and the measured figures of each step.

The library side of `python -m pipelines.train` (which adds Hydra and MLflow) and of
`benchmarks/gpu_validate.py`. Measured peak: `torch.cuda.max_memory_allocated` over the step on
CUDA (everything the step allocates: weights, gradients, optimizer state, activations); on the CPU,
where no allocator counts, the runtime's ledger of every device storage of a graph tensor
(`RunReport.device_peak_bytes`: activations, the model's temporaries, activation gradients,
recomputed and prefetched copies), which is what the simulator's `peak_activation_bytes` predicts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slackswap.graph import Graph
from slackswap.plan import Plan
from slackswap.runtime.eager import RunReport, apply
from slackswap.runtime.training_workload import Workload


@dataclass(frozen=True)
class GradCheck:
    """One step from the same weights, batch and RNG seed, plain and under the plan."""

    bit_exact: bool
    loss_plain: float
    loss_plan: float
    #: Largest absolute difference over the loss and every parameter gradient.
    max_abs_diff: float
    #: The runtime's report of the planned step (traced: per-step live copies for `explain_ledger`).
    report: RunReport


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    step_s: float
    measured_peak_bytes: int
    ledger_peak_bytes: int
    report: RunReport


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _grad_step(w: Workload, batch: torch.Tensor, seed: int, run=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    for p in w.model.parameters():
        p.grad = None
    with run or contextlib.nullcontext():
        loss = w.loss_for(batch)(w.model(*w.inputs_for(batch)))
        loss.backward()
    grads = [p.grad.detach().clone() for p in w.model.parameters() if p.grad is not None]
    for p in w.model.parameters():
        p.grad = None
    return loss.detach(), grads


def gradient_check(w: Workload, graph: Graph, plan: Plan, seed: int = 1) -> GradCheck:
    """Loss and every gradient of a plain step against a step under `plan` (weights left unchanged)."""
    plain_loss, plain = _grad_step(w, w.batch, seed)
    run = apply(plan, graph, w.model, trace=True)
    plan_loss, planned = _grad_step(w, w.batch, seed, run)
    exact, max_abs_diff = _compared((plain_loss, plain), (plan_loss, planned))
    return GradCheck(exact, float(plain_loss), float(plan_loss), max_abs_diff, run.report)


def _compared(plain: tuple[torch.Tensor, list[torch.Tensor]],
              planned: tuple[torch.Tensor, list[torch.Tensor]]) -> tuple[bool, float]:
    """(bit-exact, largest absolute difference) of two `_grad_step` results: the loss and every gradient;
    a parameter with a gradient in one step only is a difference."""
    (plain_loss, plain_grads), (plan_loss, plan_grads) = plain, planned
    if len(plain_grads) != len(plan_grads):
        return False, float("inf")
    diffs = [float((plain_loss - plan_loss).abs())]
    diffs += [float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(plain_grads, plan_grads, strict=True)]
    exact = torch.equal(plain_loss, plan_loss) and all(
        torch.equal(a, b) for a, b in zip(plain_grads, plan_grads, strict=True))
    return exact, max(diffs)


def eager_export_gradient_check(w: Workload, graph: Graph, plan: Plan, seed: int = 1) -> tuple[bool, float, int]:
    """(bit-exact, largest absolute difference, decisions executed otherwise than planned) of a plain step
    against a step under `PlanExport(plan, graph, model).installed(model)` (eager per-layer selective
    checkpointing), both from `seed`; the weights are left unchanged."""
    from slackswap.runtime.export import PlanExport

    plain = _grad_step(w, w.batch, seed)
    export = PlanExport(plan, graph, w.model)
    planned = _grad_step(w, w.batch, seed, export.installed(w.model))
    return (*_compared(plain, planned), len(export.step_differences()))


@dataclass(frozen=True)
class CompiledGradCheck:
    """A plain eager step against the plan exported to PyTorch and compiled (train.executor=compile)."""

    bit_exact: bool
    max_abs_diff: float
    #: Decisions PyTorch's machinery executes otherwise (`slackswap.runtime.export.ExportDifference`).
    differences: tuple
    #: The export and its compile backend, for `train_steps(..., export=...)` to reuse the compiled code.
    export: object = None
    backend: object = None


def compiled_gradient_check(w: Workload, graph: Graph, plan: Plan, seed: int = 1) -> CompiledGradCheck:
    from slackswap.runtime.export import PlanExport, partition_differences, recording_backend

    plain_loss, plain = _grad_step(w, w.batch, seed)
    export = PlanExport(plan, graph, w.model)
    backend, partitions = recording_backend()
    with export.installed(w.model, compile=True, backend=backend):
        plan_loss, planned = _grad_step(w, w.batch, seed)
    exact, max_abs_diff = _compared((plain_loss, plain), (plan_loss, planned))
    differences = tuple(export.static_differences() + partition_differences(export, partitions))
    return CompiledGradCheck(exact, max_abs_diff, differences, export, backend)


def train_steps(
    w: Workload,
    graph: Graph,
    plan: Plan | None,
    steps: int,
    lr: float,
    seed: int,
    on_step: Callable[[StepRecord], None] | None = None,
    executor: str = "eager",
    export: object = None,
    backend: object = "inductor",
    clock: Callable[[], float] = time.perf_counter,
) -> list[StepRecord]:
    """`steps` AdamW steps on fresh random token batches (same shape), under `plan` (None: plain).

    `executor`: "eager" runs each step under `apply`; "compile" installs the plan's export once
    (per-layer selective checkpointing, torch.compile'd; compiled on the first step). `clock`: seconds
    the step times are read from (`time.process_time` leaves out waiting for a shared core)."""
    with contextlib.ExitStack() as stack:
        run = None
        if plan is not None and executor == "compile":
            from slackswap.runtime.export import PlanExport

            export = export or PlanExport(plan, graph, w.model)
            stack.enter_context(export.installed(w.model, compile=True, backend=backend))
        elif plan is not None:
            run = apply(plan, graph, w.model)
        return _steps(w, run, steps, lr, seed, on_step, clock)


def _steps(w: Workload, run, steps: int, lr: float, seed: int, on_step, clock=time.perf_counter) -> list[StepRecord]:
    device = w.batch.device
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=lr)
    generator = torch.Generator(device=device).manual_seed(seed)
    records = []
    for i in range(steps):
        record = timed_step(w, w.model, run, optimizer, step_batch(w, generator), i, clock)
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records


def step_batch(w: Workload, generator: torch.Generator) -> torch.Tensor:
    """The next step's batch: fresh token ids from `generator` for a token model, else the workload's own."""
    if not w.token_slots:
        return w.batch
    return torch.randint(0, w.vocab_size, tuple(w.batch.shape), generator=generator, device=w.batch.device)


def timed_step(w: Workload, model: torch.nn.Module, run, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               index: int, clock: Callable[[], float] = time.perf_counter) -> StepRecord:
    """One step of `model` (the workload's, or a copy of it) on `batch` under `run` (None: plain), timed as
    every step of `train_steps` is: forward and backward on `clock`, the optimizer step after it is read."""
    device = batch.device
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = clock()
    with run or contextlib.nullcontext():
        loss = w.loss_for(batch)(model(*w.inputs_for(batch)))
        loss.backward()
    _sync(device)
    step_s = clock() - t0
    optimizer.step()
    report = run.report if run is not None else RunReport()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else report.device_peak_bytes
    return StepRecord(index, float(loss.detach()), step_s, int(peak), report.ledger_peak_bytes, report)
