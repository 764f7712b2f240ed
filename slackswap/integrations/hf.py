"""A plan in the Hugging Face `Trainer` (and TRL's trainers, which are `Trainer`s): one line.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    slackswap.integrations.hf.plan_for(trainer, budget=0.5)   # half the keep-all activation peak
    trainer.train()

`plan_for` checks the trainer's settings at once (a conflicting one is an `IntegrationError`, one line,
before anything runs) and replaces the trainer's `training_step` with one that runs the same
computation under the plan. The plan is made at the start of the first step, before that step runs,
on exactly what the trainer then runs: its first batch from its own dataloader, prepared as the
trainer prepares it, the keyword call `compute_loss` makes, the model as Accelerate prepared it (a
mixed-precision forward included), and the trainer's own arithmetic on the loss. Made there and not
earlier because only there are the batch, the prepared model and the loss scaling the ones every
later step has; the capture is one real step whose RNG, gradients and buffers are left as they were,
so training proceeds as without it. A batch of another shape (dynamic padding, a short last batch) is
planned the same way at its first step (`slackswap.integrations.step`, `max_shapes`). The plan's
predicted peak, step time and certified gap are printed; each verified step's measured peak (the
runtime's ledger) is logged beside the prediction through `trainer.log`, with a warning once if a step
exceeds it.

Why `training_step` and not a `TrainerCallback`: a plan covers forward, loss and backward and nothing
else, and no callback event brackets exactly that (`on_step_begin`/`on_step_end` enclose the optimizer
step and every micro-batch of an accumulation). The step keeps the trainer's order of operations:
`compute_loss` (called with the model's outputs, so a label smoother, `compute_loss_func` and the
token-count scaling are the trainer's own), the division for gradient accumulation where the trainer
makes it, Accelerate's division by its own accumulation steps (`Accelerator.backward`), `backward()`.
Gradient accumulation runs each micro-batch under `apply(..., accumulate=True)`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from slackswap.integrations.planning import EXECUTORS, IntegrationError, StepPlan, check_layerdrop
from slackswap.integrations.step import PlannedStep
from slackswap.integrations.verify import Tolerances


class _Called(Exception):
    def __init__(self, kwargs: dict[str, Any]):
        super().__init__("model called")
        self.kwargs = kwargs


class _ModelStandIn:
    """What `Trainer.compute_loss` gets as its model: calling it returns `outputs` (or, to learn the
    call, raises with its keywords); any attribute is the real model's (`_get_name`, `config`)."""

    def __init__(self, model: torch.nn.Module, outputs: object = None, probe: bool = False):
        self._model, self._outputs, self._probe = model, outputs, probe
        self._calls = 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        if args:
            raise IntegrationError("compute_loss", "positional model call",
                                   "the plan's step calls the model with keywords, as Trainer.compute_loss does")
        if self._probe:
            raise _Called(dict(kwargs))
        if self._calls:
            raise IntegrationError("compute_loss", "a second model call",
                                   "the plan's step runs the model once per micro-batch, as Trainer.compute_loss does")
        self._calls += 1
        return self._outputs

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)


#: Why the Trainer in several processes is refused, by Accelerate's distributed type (measured with
#: transformers 5.24, accelerate 1.16: on the CPU, `fsdp=True, fsdp_config={"fsdp_version": 2}` leaves
#: MULTI_CPU and the Trainer wraps the model in DDP; a model sharded with `fully_shard` before the
#: Trainer fails in that DDP wrap, "aten.cat.default got mixed torch.Tensor and DTensor").
_SEVERAL = {
    "MULTI_CPU": "on the CPU the Trainer wraps the model in DDP (Accelerate ignores fsdp_version=2 there), which "
                 "a plan does not run under",
    "MULTI_GPU": "the Trainer wraps the model in DDP, which a plan does not run under",
    "FSDP": "the Trainer's FSDP is not tested with a plan (Accelerate enables it only off the CPU)",
    "NO": "the Trainer's plan runs one process on one device",
}


def check_trainer(trainer: Any, executor: str) -> None:
    """Refuse, in one line, the trainer settings a plan cannot run under."""
    args, model = trainer.args, trainer.model
    if executor not in EXECUTORS:
        raise IntegrationError("executor", executor, f"must be one of {', '.join(EXECUTORS)}")
    # transformers 5 names it activation_checkpointing (gradient_checkpointing: its deprecated alias)
    new_name = hasattr(args, "activation_checkpointing")
    on_args = args.activation_checkpointing if new_name else args.gradient_checkpointing
    on_model = getattr(model, "is_activation_checkpointing" if new_name else "is_gradient_checkpointing", False)
    if on_args or on_model:
        raise IntegrationError(f"TrainingArguments.{'activation' if new_name else 'gradient'}_checkpointing", True,
                               "HF's checkpointing already recomputes every layer and conflicts with the plan's "
                               "decisions; set it to False and let the plan choose what to recompute")
    distributed = str(trainer.accelerator.distributed_type).rsplit(".", 1)[-1]
    if distributed != "NO" or args.n_gpu > 1:
        raise IntegrationError("accelerator.distributed_type", distributed if distributed != "NO" else
                               f"n_gpu={args.n_gpu}", f"{_SEVERAL.get(distributed, _SEVERAL['NO'])}; for FSDP2 "
                               "use slackswap.integrations.accelerate.plan_for in an Accelerate loop")
    if getattr(trainer.accelerator, "scaler", None) is not None:
        raise IntegrationError("TrainingArguments.fp16", True, "fp16 loss scaling is not supported; use bf16")
    if "lomo" in str(args.optim).lower():
        raise IntegrationError("TrainingArguments.optim", str(args.optim),
                               "LOMO fuses the optimizer step into backward; the plan's step cannot run it")
    if executor == "runtime" and args.torch_compile:
        raise IntegrationError("TrainingArguments.torch_compile", True,
                               "the runtime runs eager; use executor='export' for a compiled model")
    check_layerdrop(model, executor)


def warn_unbounded_padding(trainer: Any, max_shapes: int) -> str | None:
    """Warn, once, before training, when the trainer's data collator pads each batch to its own longest row
    (transformers' padding collators at `padding=True` or "longest" with `pad_to_multiple_of=None`, what the
    Trainer builds from a tokenizer): every sequence length is then a batch shape with its own plan, and the
    batch past `max_shapes` stops training hours in (`slackswap.integrations.step`). Returns the warning."""
    collator = trainer.data_collator
    if not hasattr(collator, "pad_to_multiple_of") or collator.pad_to_multiple_of is not None:
        return None
    if getattr(collator, "padding", True) not in (True, "longest"):
        return None
    message = (f"slackswap: the trainer's data collator ({type(collator).__name__}) pads each batch to its longest "
               f"row with pad_to_multiple_of=None: each sequence length is a batch shape with a plan of its own (one "
               f"capture each), and the batch past max_shapes={max_shapes} stops training; set pad_to_multiple_of "
               "(64, say) or pad to a max_length")
    warnings.warn(message, stacklevel=3)
    return message


def _reports_to_mlflow(trainer: Any) -> bool:
    """Whether `trainer.log` already reaches MLflow (transformers' `MLflowCallback`, `report_to`)."""
    return any(type(c).__name__ == "MLflowCallback" for c in trainer.callback_handler.callbacks)


def _model_call(trainer: Any, model: torch.nn.Module, inputs: Mapping[str, Any],
                num_items_in_batch: object) -> dict[str, Any]:
    """The keywords `trainer.compute_loss` calls the model with for these inputs."""
    try:
        trainer.compute_loss(_ModelStandIn(model, probe=True), dict(inputs), num_items_in_batch=num_items_in_batch)
    except _Called as called:
        return called.kwargs
    raise IntegrationError("compute_loss", type(trainer).compute_loss.__qualname__,
                           "returned without calling the model; the plan needs the model's forward in its step")


def _finish(trainer: Any, model: torch.nn.Module, inputs: Mapping[str, Any],
            num_items_in_batch: object) -> Callable[[object], torch.Tensor]:
    """The trainer's arithmetic from the model's outputs to the tensor `backward()` is called on."""

    def finish(outputs: object) -> torch.Tensor:
        loss = trainer.compute_loss(_ModelStandIn(model, outputs), dict(inputs), num_items_in_batch=num_items_in_batch)
        scaled = trainer.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                trainer.compute_loss_func is not None)
        if not scaled:
            loss = loss / trainer.current_gradient_accumulation_steps
        return loss / trainer.accelerator.gradient_accumulation_steps  # what Accelerator.backward divides by

    return finish


def _step(trainer: Any, planned: PlannedStep, model: torch.nn.Module, inputs: Mapping[str, Any],
          num_items_in_batch: object = None) -> torch.Tensor:
    """`Trainer.training_step` under the plan: forward, the trainer's loss arithmetic, backward."""
    model.train()
    if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
        trainer.optimizer.train()
    inputs = trainer._prepare_inputs(inputs)
    call = _model_call(trainer, model, inputs, num_items_in_batch)
    finish = _finish(trainer, model, inputs, num_items_in_batch)
    loss, figures = planned.run(model, call, finish, trainer.compute_loss_context_manager)
    if figures is not None:
        trainer.log(dict(figures))
    return loss.detach()


def plan_for(trainer: Any, budget: object = 0.5, *, planner: str = "slackswap", hardware: object = None,
             executor: str = "runtime", verify_steps: int = 1, certify: bool = False,
             plan: StepPlan | None = None, printer: Callable[[str], None] = print,
             peak_tolerance: float = 0.0, step_tolerance: float = 0.5, max_shapes: int = 8) -> PlannedStep:
    """Run every training step of `trainer` under a plan of its model's step within `budget`.

    `budget`: a fraction of the keep-all activation peak (float in (0, 1]), bytes (int), "device" or a
    `slackswap.budget.Budget`. `planner`: a registered planner's name. `hardware`: the preset the plan
    is timed on (default `a100_80gb_pcie4`). `executor`: "runtime" (`slackswap.runtime.apply`,
    bit-exact) or "export" (PyTorch's selective checkpointing, a plan made for it). `verify_steps`:
    how many first steps run verified, each logging its measured peak beside the predicted one.
    `certify`: bound the step with the `milp` planner, for the certified gap the summary prints.
    `plan`: a `StepPlan` made before (by an earlier `plan_for`): refused at the first step if it was
    made for another model or batch shape, and at the first batch of another shape. `peak_tolerance`,
    `step_tolerance`: how far a verified step may be from the prediction before it warns
    (`slackswap.integrations.verify.Tolerances`). `max_shapes`: how many batch shapes get a plan of their
    own, each captured and planned at its first batch (dynamic padding, a short last batch); one more is
    refused before its step (`slackswap.integrations.step`).
    The verified figures go through `trainer.log`, and to the active MLflow run when the user has
    one and no `MLflowCallback` of the trainer already takes them there."""
    tolerances = Tolerances(peak_tolerance, step_tolerance)
    check_trainer(trainer, executor)
    if plan is None:
        warn_unbounded_padding(trainer, max_shapes)
    state = PlannedStep(budget, planner, hardware, executor, verify_steps, certify, planned=plan, printer=printer,
                        tolerances=tolerances, reports_to_mlflow=lambda: _reports_to_mlflow(trainer),
                        max_shapes=max_shapes)

    def training_step(model: torch.nn.Module, inputs: Mapping[str, Any], num_items_in_batch: object = None):
        return _step(trainer, state, model, inputs, num_items_in_batch)

    trainer.training_step = training_step
    return state
