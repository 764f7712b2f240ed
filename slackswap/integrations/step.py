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

A plan describes one step of one batch shape. Loaders pad each batch to its longest sequence (Hugging
Face's `DataCollatorWithPadding`) and end an epoch on a short batch, so a batch of a shape not seen
before is captured and planned like the first (same budget, planner and executor; its own first
`verify_steps` steps verified) and kept beside the others, up to `max_shapes` shapes; one more is
refused before its step, in one line that says to pad to a multiple (`pad_to_multiple_of`). Under
FSDP2 a new shape is refused: the capture runs the step's collectives, and a rank alone at a new
shape would run them without the other ranks.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slackswap.integrations.distributed import check_processes, is_fsdp2, rank_suffix, settle_fsdp2
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


#: After how many steps re-verified for one reason `PlannedStep` says so (once per reason).
REVERIFIED_WARNING = 3


def _values(call: Mapping[str, object] | Sequence[object]) -> list[object]:
    return list(call.values()) if isinstance(call, Mapping) else list(call)


def _padded(call: Mapping[str, object] | Sequence[object]) -> bool | None:
    """Whether a Hugging Face batch's `attention_mask` masks any position (None: the call has none). A
    Hugging Face decoder skips its attention mask when it masks nothing (`attention_mask.all()`, read in
    forward), another code path than a padded batch's of the same shape: each gets a plan of its own."""
    mask = call.get("attention_mask") if isinstance(call, Mapping) else None
    return not bool(mask.all()) if isinstance(mask, torch.Tensor) else None


def _shape_key(call: Mapping[str, object] | Sequence[object]) -> tuple:
    """What tells one batch shape's plan from another's: the call's keywords, its tensors' shapes and dtypes,
    and whether its attention mask masks anything (`_padded`)."""
    keys = tuple(call) if isinstance(call, Mapping) else None
    return keys, tuple((tuple(shape), dtype) for shape, dtype in input_signature(_values(call))), _padded(call)


@dataclass
class _ShapePlan:
    """One batch shape's plan, the runner that executes it, its peak check and how many steps it ran."""

    planned: StepPlan
    runner: Any
    peaks: PeakCheck
    steps: int = 0


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
    #: How many batch shapes get a plan of their own (each captured at its first step: one extra
    #: unplanned forward and backward at its keep-all peak); 1 plans the first batch's shape only.
    max_shapes: int = 8
    steps: int = 0
    _runner: Any = None
    _context: Any = None
    #: Per reason (`RunReport.verified_because`), the steps past each shape's verified ones that ran verified.
    reverified: dict[str, int] = field(default_factory=dict)
    #: Each batch shape's plan (`_shape_key`), in the order the shapes came.
    _shapes: dict[tuple, _ShapePlan] = field(default_factory=dict)
    _shape: _ShapePlan | None = None
    #: The name of the plan given to the constructor (made before, for one batch shape), or None.
    _given: str | None = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise IntegrationError("executor", self.executor, f"must be one of {', '.join(EXECUTORS)}")
        for name in ("verify_steps", "max_shapes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise IntegrationError(name, v, "must be a positive integer")
        self._given = None if self.planned is None else self.planned.graph.name

    @property
    def plans(self) -> list[StepPlan]:
        """Each batch shape's plan, in the order the shapes came (`planned` is the current one's)."""
        return [shape.planned for shape in self._shapes.values()]

    def prepare(self, model: torch.nn.Module, call: Mapping[str, object] | Sequence[object],
                finish: Callable[[object], torch.Tensor]) -> None:
        """Capture and plan the step (or check the plan given against this model and call). In
        several processes, each rank plans its own step: under FSDP2, after its first step has run
        plain (`slackswap.integrations.distributed`); DDP, FSDP1 and DeepSpeed are refused."""
        from slackswap.runtime import apply
        from slackswap.runtime.export import PlanExport

        if not self._shapes:
            check_processes(model, self.executor)
            check_layerdrop(model, self.executor)
            settle_fsdp2(model, call, finish)
        signature = input_signature(_values(call))
        shape_key = _shape_key(call)
        if self.planned is not None and not self._shapes:  # a plan made before: checked, for its one shape
            planned = self.planned
            for key, now in (("model_signature", model_signature(model)), ("input_signature", signature)):
                if planned.graph.meta.get(key) != now:
                    raise IntegrationError(f"plan.graph.meta[{key!r}]", planned.graph.meta.get(key),
                                           f"the plan was made for another {key.split('_')[0]}: this run has {now}")
        else:
            shape = "x".join(str(d) for d in signature[0][0]) if signature else "()"
            name = f"{type(model).__name__}@{shape}{'+padding' if shape_key[2] else ''}{rank_suffix()}"
            graph = capture_step(model, call, finish, hardware_of(self.hardware), name)
            planned = plan_step(graph, model, self.budget, self.planner, self.hardware, self.executor, self.certify)
        self.printer(planned.summary())
        if self.executor == "export":
            runner = PlanExport(planned.plan, planned.graph, model)
        else:
            runner = apply(planned.plan, planned.graph, model, accumulate=True)
        self._shapes[shape_key] = _ShapePlan(planned, runner, PeakCheck(planned, self.tolerances))
        self._switch(shape_key)

    def _switch(self, key: tuple) -> None:
        """Make the plan of batch shape `key` the current one (`planned`, `peaks`, the runner)."""
        self._shape = self._shapes[key]
        self.planned, self.peaks, self._runner = self._shape.planned, self._shape.peaks, self._shape.runner

    def _plan_for_shape(self, model: torch.nn.Module, call: Mapping[str, object] | Sequence[object],
                        finish: Callable[[object], torch.Tensor]) -> None:
        """Before a step: the plan of this call's batch shape, made now if the shape is new."""
        key = _shape_key(call)
        if key in self._shapes:
            self._switch(key)
            return
        if self._given:
            raise IntegrationError("plan", self._given,
                                   f"was made for inputs {self.plans[0].graph.meta.get('input_signature')}; this batch "
                                   f"has {input_signature(_values(call))}: pass no plan, and each batch shape is "
                                   "planned at its first step")
        if is_fsdp2(model):
            raise IntegrationError("inputs", input_signature(_values(call)),
                                   f"another batch shape than this rank's plan ({self.plans[0].graph.name}) under "
                                   "FSDP2: its capture runs the step's collectives, which a rank alone at a new shape "
                                   "would run without the others (a hang); pad every rank's batches to one shape")
        if len(self._shapes) >= self.max_shapes:
            seen = ", ".join(p.graph.name.partition("@")[2] for p in self.plans)
            raise IntegrationError("max_shapes", self.max_shapes,
                                   f"a batch of inputs {input_signature(_values(call))} would need one more plan "
                                   f"(planned: {seen}); pad batches to a multiple of a length "
                                   "(DataCollatorWithPadding(pad_to_multiple_of=...)), keep the last batch full "
                                   "(drop_last), or allow more shapes")
        self.prepare(model, call, finish)

    def enter(self, model: torch.nn.Module, call: Mapping[str, object] | Sequence[object],
              finish: Callable[[object], torch.Tensor]) -> None:
        """Start one step under the plan (planning it first at the first step); `exit` ends it. For a
        trainer whose step starts and ends in two different hooks (Lightning)."""
        if self._runner is None:
            self.prepare(model, call, finish)
        else:
            self._plan_for_shape(model, call, finish)
        runner = self._runner
        self._verify = self.executor == "runtime" and self._shape.steps < self.verify_steps
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
        self._shape.steps += 1
        if exc_type is None and self.executor == "runtime" and not self._verify and self._runner.report.verified:
            self._note_reverified(self._runner.report.verified_because or "unknown")
        if exc_type is not None or not (self._verify and self._runner.report.verified):
            return None
        figures = self.peaks.observe(self._runner.report.device_peak_bytes, step_s)
        self.logged.append(dict(figures))
        if not self.reports_to_mlflow() and log_to_mlflow(figures, self.steps - 1):
            self.mlflow_steps.append(self.steps - 1)
        return figures

    def _note_reverified(self, because: str) -> None:
        """A step past the first `verify_steps` of its shape ran verified (the runtime's dispatch modes: several
        times a hook-only step's time): counted per reason (`reverified`), and said once per reason when it
        happened `REVERIFIED_WARNING` times, so a run that stays slow says why."""
        count = self.reverified[because] = self.reverified.get(because, 0) + 1
        if count == REVERIFIED_WARNING:
            warnings.warn(f"slackswap: {count} steps of {self.planned.graph.name} past the verified ones ran verified "
                          f"(the runtime's checked path, several times a step on hooks alone) because {because}",
                          stacklevel=3)

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
