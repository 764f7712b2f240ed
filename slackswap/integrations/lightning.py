"""A plan in Lightning: a `Callback`, `Trainer(callbacks=[SlackSwapCallback(budget=0.5)])`.

    from slackswap.integrations.lightning import SlackSwapCallback

Lightning's automatic optimization runs, per batch, `training_step`, then its own arithmetic on the
returned loss (divided by `accumulate_grad_batches`; a detached copy kept for logging), then
`backward` and `on_after_backward`. The plan covers exactly that stretch: the callback replaces the
LightningModule's `training_step` (on the instance, for the fit) with one that starts the planned
step and calls the original through `_TrainingStep`, a module whose forward is the user's
`training_step` (the runtime names tensors by module path and reads the step's inputs from a module
call, and a LightningModule's `training_step` is not one); the module's `backward` hook, wrapped the
same way, ends it (before Lightning's `post_backward`, whose `detach` no captured step has). Lightning
zeroes the gradients between the two (`optimizer_zero_grad`), inside that stretch: for the fit the
callback zeroes them as `zero_grad(set_to_none=True)` does, without the profiler's `record_function`
around it, whose calls no captured step has. The plan is
made at the first batch, on that batch and that arithmetic (`SlackSwapCallback.finish`). Its verified
first step's figures go to the trainer's loggers (`log_metrics`).

Not supported: tensors logged with `self.log` inside `training_step` (Lightning's first log creates
its metric state, an ATen sequence no later step repeats: the runtime stops the step with a
`PlanMismatchError`), manual optimization, an overridden `optimizer_zero_grad`, several processes
on a model that is not FSDP2 (DDP, FSDP1 by name), 16-bit precision with a scaler. Several processes
on an FSDP2 model (`ModelParallelStrategy`, `fully_shard` in `configure_model`): each rank plans its
own step (`slackswap.integrations.distributed`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from slackswap.integrations.distributed import check_processes, is_fsdp2
from slackswap.integrations.planning import IntegrationError, StepPlan
from slackswap.integrations.step import PlannedStep
from slackswap.integrations.verify import Tolerances


class _TrainingStep(torch.nn.Module):
    """`training_step(batch, *rest)` as a module call on the batch's tensors (in its flattening order)."""

    def __init__(self, module: torch.nn.Module, step: Callable[..., object]):
        super().__init__()
        self.module = module
        self._step = step
        self._leaves: list[object] = []
        self._spec: Any = None
        self._rest: tuple[object, ...] = ()

    def bind(self, batch: object, rest: tuple[object, ...]) -> list[torch.Tensor]:
        """Remember the batch's structure and its non-tensor leaves; return its tensors."""
        self._leaves, self._spec = tree_flatten(batch)
        self._rest = rest
        return [x for x in self._leaves if isinstance(x, torch.Tensor)]

    def forward(self, *tensors: torch.Tensor) -> object:
        it = iter(tensors)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self._leaves]
        return self._step(tree_unflatten(leaves, self._spec), *self._rest)


class PlanCallback:
    """Run every training step under a plan within `budget` (arguments as `slackswap.integrations.hf.plan_for`).
    The hooks; `SlackSwapCallback` is this and Lightning's `Callback`."""

    def __init__(self, budget: object = 0.5, *, planner: str = "slackswap", hardware: object = None,
                 executor: str = "runtime", verify_steps: int = 1, certify: bool = False,
                 plan: StepPlan | None = None, printer: Callable[[str], None] = print,
                 peak_tolerance: float = 0.0, step_tolerance: float = 0.5, max_shapes: int = 8):
        self.planned = PlannedStep(budget, planner, hardware, executor, verify_steps, certify, planned=plan,
                                   printer=printer, tolerances=Tolerances(peak_tolerance, step_tolerance),
                                   reports_to_mlflow=lambda: self._reports_to_mlflow, max_shapes=max_shapes)
        #: Whether one of the trainer's loggers is Lightning's `MLFlowLogger` (then the verified figures
        #: reach MLflow through it, once).
        self._reports_to_mlflow = False
        self._wrapper: _TrainingStep | None = None
        self._accumulate = 1
        #: The gradients set aside during a step (earlier micro-batches'), as (parameter, gradient).
        self._aside: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._loss_copy: torch.Tensor | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise IntegrationError("LightningModule.automatic_optimization", False,
                                   "the plan brackets Lightning's automatic training step and backward")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise IntegrationError("Trainer.precision", trainer.precision, "16-bit loss scaling is not supported")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning.pytorch import LightningModule

        if trainer.world_size > 1:
            # Here and not in `setup`: the strategy has wrapped (DDP, FSDP1) or sharded (FSDP2, in
            # `configure_model`) the module only now.
            check_processes(trainer.strategy.model, self.planned.executor)
            if not is_fsdp2(pl_module):
                raise IntegrationError("Trainer.world_size", trainer.world_size,
                                       "several processes run a plan only on an FSDP2 model: ModelParallelStrategy "
                                       "with fully_shard in configure_model")
        if type(pl_module).optimizer_zero_grad is not LightningModule.optimizer_zero_grad:
            raise IntegrationError("LightningModule.optimizer_zero_grad", "overridden",
                                   "Lightning calls it between training_step and backward, inside the planned step")
        self._accumulate = trainer.accumulate_grad_batches
        self._reports_to_mlflow = any(type(lg).__name__ == "MLFlowLogger" for lg in trainer.loggers)

        def optimizer_zero_grad(epoch: int, batch_idx: int, optimizer: Any) -> None:
            # What optimizer.zero_grad() (set_to_none) does, without its profiler record_function: Lightning
            # calls this between training_step and backward, so its ATen calls would be inside the plan's step.
            # The step set the gradients aside at its start; zeroing them is dropping what it set aside.
            params = {id(p) for group in optimizer.param_groups for p in group["params"]}
            self._aside = [(p, g) for p, g in self._aside if id(p) not in params]
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

        pl_module.optimizer_zero_grad = optimizer_zero_grad
        original_backward = pl_module.backward

        def backward(loss: torch.Tensor, *args: object, **kwargs: object) -> None:
            # The step ends with backward: Lightning's post_backward detaches the loss before
            # on_after_backward, an ATen call after the plan's last step.
            try:
                original_backward(loss, *args, **kwargs)
            except BaseException as failure:
                if self.planned.active:
                    self.planned.exit(type(failure), failure, failure.__traceback__)
                self._restore()
                raise
            if self.planned.active:
                try:
                    figures = self.planned.exit()
                finally:
                    self._restore()
                if figures is not None:
                    for logger in pl_module.trainer.loggers:
                        logger.log_metrics(dict(figures), step=pl_module.trainer.global_step)

        pl_module.backward = backward
        original = pl_module.training_step
        self._wrapper = wrapper = _TrainingStep(pl_module, original)

        def training_step(batch: object, *rest: object) -> object:
            tensors = wrapper.bind(batch, rest)
            # The gradients of earlier micro-batches go aside for the step (Lightning zeroes them, or not,
            # only after training_step) and are added back after backward, as AccumulateGrad adds.
            self._aside = [(p, p.grad) for p in pl_module.parameters() if p.grad is not None]
            for p, _ in self._aside:
                p.grad = None
            self.planned.enter(wrapper, tensors, self.finish)
            try:
                return wrapper(*tensors)
            except BaseException as failure:
                self.planned.exit(type(failure), failure, failure.__traceback__)
                self._restore()
                raise

        pl_module.training_step = training_step
        self._original = original

    def _restore(self) -> None:
        for p, old in self._aside:
            p.grad = old if p.grad is None else old.add_(p.grad)
        self._aside = []

    def finish(self, output: object) -> torch.Tensor:
        """Lightning's arithmetic from `training_step`'s output to the tensor it calls `backward` on
        (`ClosureResult.from_training_step_output`): the loss over the accumulation, and its copy."""
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise IntegrationError("training_step", type(output).__name__, "must return the loss tensor (or a dict)")
        loss = loss / self._accumulate
        # ClosureResult keeps a detached copy: the same ATen calls, and the copy held as long
        self._loss_copy = loss.detach().clone()
        return loss

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.planned.active:
            self.planned.exit(type(exception), exception, exception.__traceback__)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._wrapper is not None:
            del pl_module.training_step  # the class's own again
            del pl_module.optimizer_zero_grad
            del pl_module.backward
            self._wrapper = None


def __getattr__(name: str) -> type:
    """`SlackSwapCallback`, made on first use: Lightning is imported only by who uses it (importing
    this module, as the library's import checks do, needs no Lightning)."""
    if name != "SlackSwapCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from lightning.pytorch.callbacks import Callback

    made = type("SlackSwapCallback", (PlanCallback, Callback),
                {"__module__": __name__, "__doc__": PlanCallback.__doc__})
    globals()[name] = made
    return made
