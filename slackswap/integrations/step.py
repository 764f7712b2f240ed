"""One planned training step per micro-batch, for any trainer's loop (imports torch).

A trainer integration knows two things about its loop: the model call it makes (`call`: keywords, or
positional arguments) and its arithmetic from the model's outputs to the tensor it calls `backward()`
on (`finish`). `PlannedStep` does the rest: at its first step it captures that step and plans it (or
checks a plan made before against it), prints the plan's summary, and from then on runs each step
under the runtime (`apply(..., accumulate=True)`: micro-batches add to the gradients as plain PyTorch
does) or inside the export; the first `verify_steps` steps run verified and return their measured
peak and step time beside the prediction (`slackswap.integrations.verify.PeakCheck`, within
`tolerances`), which also go to the active MLflow run when the user has one and the trainer's own
logger does not already report there (`reports_to_mlflow`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slackswap.integrations.distributed import check_processes, rank_suffix, settle_fsdp2
from slackswap.integrations.planning import (
    EXECUTORS,
    IntegrationError,
    StepPlan,
    capture_step,
    check_layerdrop,
    hardware_of,
    plan_step,
)
from slackswap.integrations.verify import PeakCheck, Tolerances, log_to_mlflow
from slackswap.runtime.capture import input_signature, model_signature


def _never() -> bool:
    return False


def _values(call: Mapping[str, object] | Sequence[object]) -> list[object]:
    return list(call.values()) if isinstance(call, Mapping) else list(call)


@dataclass
class PlannedStep:
    """The plan of a trainer's step (made at the first step) and each verified step's figures."""

    budget: object
    planner: str = "slackswap"
    hardware: object = None
    executor: str = "runtime"
    verify_steps: int = 1
    certify: bool = False
    planned: StepPlan | None = None
    printer: Callable[[str], None] = print
    peaks: PeakCheck | None = None
    #: One dict per verified step: predicted and measured peak, budget, step time.
    logged: list[dict[str, float]] = field(default_factory=list)
    tolerances: Tolerances = field(default_factory=Tolerances)
    #: Whether the trainer's own logger already sends its metrics to MLflow (then the verified
    #: figures reach MLflow through it, once); asked at each verified step.
    reports_to_mlflow: Callable[[], bool] = _never
    #: Which verified steps went to the active MLflow run directly (their `steps` index).
    mlflow_steps: list[int] = field(default_factory=list)
    steps: int = 0
    _runner: Any = None
    _context: Any = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise IntegrationError("executor", self.executor, f"must be one of {', '.join(EXECUTORS)}")
        v = self.verify_steps
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise IntegrationError("verify_steps", v, "must be a positive integer")

    def prepare(self, model: torch.nn.Module, call: Mapping[str, object] | Sequence[object],
                finish: Callable[[object], torch.Tensor]) -> None:
        """Capture and plan the step (or check the plan given against this model and call). In
        several processes, each rank plans its own step: under FSDP2, after its first step has run
        plain (`slackswap.integrations.distributed`); DDP, FSDP1 and DeepSpeed are refused."""
        from slackswap.runtime import apply
        from slackswap.runtime.export import PlanExport

        check_processes(model, self.executor)
        check_layerdrop(model, self.executor)
        settle_fsdp2(model, call, finish)
        signature = input_signature(_values(call))
        if self.planned is not None:
            graph = self.planned.graph
            for key, now in (("model_signature", model_signature(model)), ("input_signature", signature)):
                if graph.meta.get(key) != now:
                    raise IntegrationError(f"plan.graph.meta[{key!r}]", graph.meta.get(key),
                                           f"the plan was made for another {key.split('_')[0]}: this run has {now}")
        else:
            shape = "x".join(str(d) for d in signature[0][0]) if signature else "()"
            name = f"{type(model).__name__}@{shape}{rank_suffix()}"
            graph = capture_step(model, call, finish, hardware_of(self.hardware), name)
            self.planned = plan_step(graph, model, self.budget, self.planner, self.hardware, self.executor,
                                     self.certify)
        self.printer(self.planned.summary())
        self.peaks = PeakCheck(self.planned, self.tolerances)
        if self.executor == "export":
            self._runner = PlanExport(self.planned.plan, graph, model)
        else:
            self._runner = apply(self.planned.plan, graph, model, accumulate=True)

    def enter(self, model: torch.nn.Module, call: Mapping[str, object] | Sequence[object],
              finish: Callable[[object], torch.Tensor]) -> None:
        """Start one step under the plan (planning it first at the first step); `exit` ends it. For a
        trainer whose step starts and ends in two different hooks (Lightning)."""
        if self._runner is None:
            self.prepare(model, call, finish)
        runner = self._runner
        self._verify = self.executor == "runtime" and self.steps < self.verify_steps
        if self.executor == "runtime":
            runner.verify = self._verify
            self._context = runner
        else:
            self._context = runner.installed(model)
        self._on_cuda = any(p.is_cuda for p in model.parameters())
        self._context.__enter__()
        self._t0 = time.perf_counter()

    def exit(self, exc_type: type | None = None, exc: BaseException | None = None,
             tb: object = None) -> dict[str, float] | None:
        """End the step `enter` started; for a verified step, its figures (measured and predicted
        peak, budget, step time)."""
        context, self._context = self._context, None
        context.__exit__(exc_type, exc, tb)
        if self._on_cuda:
            torch.cuda.synchronize()
        step_s = time.perf_counter() - self._t0
        self.steps += 1
        if exc_type is not None or not (self._verify and self._runner.report.verified):
            return None
        figures = self.peaks.observe(self._runner.report.device_peak_bytes, step_s)
        self.logged.append(dict(figures))
        if not self.reports_to_mlflow() and log_to_mlflow(figures, self.steps - 1):
            self.mlflow_steps.append(self.steps - 1)
        return figures

    @property
    def active(self) -> bool:
        """Between `enter` and `exit`."""
        return self._context is not None

    def run(self, model: torch.nn.Module, call: Mapping[str, object] | Sequence[object],
            finish: Callable[[object], torch.Tensor],
            around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            ) -> tuple[torch.Tensor, dict[str, float] | None]:
        """`finish(model(call)).backward()` under the plan (`around()` entered inside it: a trainer's
        autocast); returns the tensor backward ran from and, for a verified step, its figures."""
        self.enter(model, call, finish)
        try:
            with around():
                loss = finish(model(**call) if isinstance(call, Mapping) else model(*call))
                loss.backward()
        except BaseException as failure:
            self.exit(type(failure), failure, failure.__traceback__)
            raise
        return loss, self.exit()
