"""A plan in a hand-written Accelerate loop: one call replaces forward, loss and `accelerator.backward`.

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    step = slackswap.integrations.accelerate.plan_for(accelerator, model, budget=0.5)
    for batch in data:
        with accelerator.accumulate(model):
            loss = step(batch)              # was: loss = model(**batch).loss; accelerator.backward(loss)
            optimizer.step(); optimizer.zero_grad()

The step is the same computation `accelerator.backward` runs (the loss divided by the accelerator's
accumulation steps, then `backward()`), under the plan, which is made at the first call on that
batch (`slackswap.integrations.step.PlannedStep`). The first step's measured peak goes to
`accelerator.log` (the trackers the user started) beside the prediction. Why a call and not a plugin:
Accelerate's plugins configure distributed back-ends; none brackets one step's forward and backward.
In several processes each rank plans its own step of an FSDP2 model (`check_accelerator`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from slackswap.integrations.distributed import check_processes, is_fsdp2
from slackswap.integrations.planning import IntegrationError, StepPlan
from slackswap.integrations.step import PlannedStep
from slackswap.integrations.verify import Tolerances


def model_loss(outputs: object, batch: object) -> torch.Tensor:
    """The loss an HF model returns when the batch has labels (`outputs["loss"]`, else `outputs[0]`)."""
    return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]


def check_accelerator(accelerator: Any, model: torch.nn.Module, executor: str = "runtime") -> None:
    """Refuse, in one line, the Accelerate settings a plan cannot run under. Several processes run a
    plan only on an FSDP2 model (`slackswap.integrations.distributed`): Accelerate's FSDP plugin at
    `fsdp_version=2` makes one on CUDA; on the CPU, Accelerate 1.16 ignores the plugin
    (`distributed_type` stays MULTI_CPU and `prepare` wraps the model in DDP), so there the user shards
    the model with `fully_shard` and leaves it out of `prepare`."""
    distributed = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    if distributed != "NO":
        check_processes(model, executor)  # DDP (what `prepare` makes under MULTI_*), FSDP1, DeepSpeed
        if not is_fsdp2(model):
            raise IntegrationError("accelerator.distributed_type", distributed,
                                   "several processes run a plan only on an FSDP2 model: Accelerate's FSDP plugin "
                                   "with fsdp_version=2, or fully_shard the model and leave it out of prepare")
    if getattr(accelerator, "scaler", None) is not None:
        raise IntegrationError("accelerator.mixed_precision", "fp16", "fp16 loss scaling is not supported; use bf16")


class AcceleratePlan:
    """`step(batch)`: forward (`model(**batch)` for a mapping, `model(*batch)` for a tuple or list,
    `model(batch)` for a tensor), `loss(outputs, batch)`, `accelerator.backward`, under the plan;
    returns the loss, detached."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, planned: PlannedStep,
                 loss: Callable[[object, object], torch.Tensor]):
        self.accelerator, self.model, self.planned, self.loss = accelerator, model, planned, loss

    def __call__(self, batch: object) -> torch.Tensor:
        if isinstance(batch, torch.Tensor):
            call: object = (batch,)
        elif isinstance(batch, (Mapping, tuple, list)):
            call = batch
        else:
            raise IntegrationError("batch", type(batch).__name__, "must be a mapping, a tuple, a list or a tensor")
        losses: list[torch.Tensor] = []

        def finish(outputs: object) -> torch.Tensor:
            losses.append(self.loss(outputs, batch))
            return losses[-1] / self.accelerator.gradient_accumulation_steps  # as Accelerator.backward does

        _, figures = self.planned.run(self.model, call, finish)
        if figures is not None:
            self.accelerator.log(dict(figures))
        return losses[-1].detach()


def plan_for(accelerator: Any, model: torch.nn.Module, budget: object = 0.5, *,
             loss: Callable[[object, object], torch.Tensor] = model_loss, planner: str = "slackswap",
             hardware: object = None, executor: str = "runtime", verify_steps: int = 1, certify: bool = False,
             plan: StepPlan | None = None, printer: Callable[[str], None] = print,
             peak_tolerance: float = 0.0, step_tolerance: float = 0.5, max_shapes: int = 8) -> AcceleratePlan:
    """The planned step of `model` (as `accelerator.prepare` returned it) within `budget`; the
    arguments are `slackswap.integrations.hf.plan_for`'s, and `loss(outputs, batch)` is the user's
    loss of the model's outputs (default: the loss an HF model computes from the batch's labels). The
    verified figures go to `accelerator.log`, and to the active MLflow run when the user has one and
    the accelerator has no mlflow tracker already taking them there."""
    tolerances = Tolerances(peak_tolerance, step_tolerance)
    check_accelerator(accelerator, model, executor)
    planned = PlannedStep(budget, planner, hardware, executor, verify_steps, certify, planned=plan, printer=printer,
                          tolerances=tolerances, max_shapes=max_shapes,
                          reports_to_mlflow=lambda: any(getattr(t, "name", None) == "mlflow"
                                                        for t in accelerator.trackers))
    return AcceleratePlan(accelerator, model, planned, loss)
