"""Capture, plan, predict and verify one training step, for any trainer (imports torch).

A trainer calls its model with keyword arguments (`model(**batch)`) and then does its own arithmetic
on the loss before `backward()`. A plan describes one step ATen call by ATen call, so the step the
plan is made on must be the step the trainer runs: `capture_step` records exactly the call the trainer
makes (`slackswap.runtime.capture_graph` calls `model(*inputs)`, so the model's forward is called
with the same keywords for the length of the capture, `called_with_keywords`) and exactly the loss
arithmetic the trainer's integration will run (`finish`). `plan_step` then prices the budget against
the captured step's keep-all peak, plans, simulates, and keeps what it predicts: the peak on this
device's link (what the runtime's ledger measures) and the step time and gap on the chosen hardware.
`slackswap.integrations.verify.PeakCheck` compares the verified steps' measured figures with that
prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from slackswap.budget import Budget
from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware, load_preset
from slackswap.plan import Plan

#: The executors a trainer integration can run a plan with: the runtime's hooks (`apply`, bit-exact,
#: swaps at the plan's positions) or PyTorch's selective checkpointing (`PlanExport`, eager).
EXECUTORS = ("runtime", "export")
#: The simulated hardware when the caller names none (conf/hardware/a100_80gb_pcie4.yaml), as in
#: docs/runtime.md's example.
DEFAULT_HARDWARE = "a100_80gb_pcie4"


class IntegrationError(ConfigError):
    """A trainer setting, budget or plan that cannot run as planned: one line naming the field, the
    value and what to do, raised before the first training step."""


@contextmanager
def called_with_keywords(model: torch.nn.Module, keys: tuple[str, ...]) -> Iterator[None]:
    """For the duration: `model(*values)` calls the model's forward as `forward(**dict(zip(keys,
    values)))`. The module itself (its class, paths, hooks, parameters) is untouched, so the captured
    graph names what the trainer's own `model(**batch)` call will run; an instance-level forward
    (Accelerate's mixed-precision wrapper) is the one called, and restored after."""
    own = model.__dict__.get("forward")
    inner = model.forward

    def forward(*values: object) -> object:
        return inner(**dict(zip(keys, values, strict=True)))

    model.forward = forward
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


#: Hugging Face configs' LayerDrop rates (wav2vec2, HuBERT, Whisper, BART and its kin).
LAYERDROP_KEYS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
#: Hugging Face configs' SpecAugment rates (wav2vec2, HuBERT, Whisper and their kin, when
#: `apply_spec_augment`): the masked spans are drawn with `numpy.random` on each training step.
SPEC_AUGMENT_KEYS = ("mask_time_prob", "mask_feature_prob")


def check_layerdrop(model: torch.nn.Module, executor: str) -> None:
    """Refuse the runtime for a model whose Hugging Face config drops layers at random in training, or masks
    spans drawn at random (SpecAugment): the runtime runs the step it captured, its hook-only steps refuse
    another path, and a forward that draws from NumPy's generator runs every step verified, where another
    count of masked spans is refused (docs/runtime.md, "Hook-only steps", "Numbers drawn in forward"); the
    export's checkpoints re-run each layer's own forward, and replay its draws."""
    if executor != "runtime":
        return
    for module in model.modules():
        config = getattr(module, "config", None)
        for key in LAYERDROP_KEYS if config is not None else ():
            rate = getattr(config, key, 0.0) or 0.0
            if isinstance(rate, (int, float)) and rate > 0:
                raise IntegrationError(f"model.config.{key}", rate,
                                       "LayerDrop skips other layers on each step, and the runtime runs the step it "
                                       "captured; use executor='export' (its checkpoints re-run each layer's own "
                                       "forward) or set it to 0")
        augments = config is not None and getattr(config, "apply_spec_augment", False) is True
        for key in SPEC_AUGMENT_KEYS if augments else ():
            rate = getattr(config, key, 0.0) or 0.0
            if isinstance(rate, (int, float)) and rate > 0:
                raise IntegrationError(f"model.config.{key}", rate,
                                       "SpecAugment masks a count of spans drawn with numpy.random on each step, and "
                                       "the runtime runs the step it captured (a step with another count is refused); "
                                       "use executor='export' (its checkpoints re-run each layer's own forward) or "
                                       "set it to 0")


def capture_step(model: torch.nn.Module, call: Mapping[str, object] | Sequence[object],
                 finish: Callable[[object], torch.Tensor], hardware: Hardware, name: str) -> Graph:
    """The graph of one step: `finish(model(**call)).backward()` (`model(*call)` for a sequence),
    captured (RNG, gradients and buffers left as they were, `capture_graph`)."""
    from slackswap.runtime import capture_graph

    if not isinstance(call, Mapping):
        return capture_graph(model, list(call), finish, hardware, name=name)
    keys = tuple(call)
    with called_with_keywords(model, keys):
        return capture_graph(model, [call[k] for k in keys], finish, hardware, name=name)


def hardware_of(hardware: Hardware | str | None) -> Hardware:
    """A `Hardware`, a preset's name (conf/hardware/), or None for `DEFAULT_HARDWARE`."""
    return hardware if isinstance(hardware, Hardware) else load_preset(hardware or DEFAULT_HARDWARE)


def resolve_budget(budget: object, keep_all_peak_bytes: int, model: torch.nn.Module) -> int:
    """Bytes for activations: a fraction in (0, 1] (a float) of the keep-all peak, a byte count (an int), "device"
    (the CUDA device's memory less what the model, its gradients and an Adam-like optimizer's two
    moments take and `Budget`'s reserve), or a `slackswap.budget.Budget`."""
    if isinstance(budget, Budget):
        spec = budget
    elif budget == "device":
        spec = Budget(device=True)
    elif isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise IntegrationError("budget", budget, 'must be a fraction in (0, 1], a byte count (int) or "device"')
    elif isinstance(budget, float):
        spec = Budget(fraction=float(budget))
    else:
        spec = Budget(bytes=budget)
    capacity = None
    if spec.device:
        params = list(model.parameters())
        if not params or not params[0].is_cuda:
            raise IntegrationError("budget", "device", "needs the model on a CUDA device; give a fraction or bytes")
        device = params[0].device
        total = torch.cuda.get_device_properties(device).total_memory
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        capacity = total - torch.cuda.memory_allocated(device) - 3 * param_bytes - spec.reserve_bytes
        if capacity <= 0:
            raise IntegrationError("budget", "device", f"the model's static state leaves {capacity} B for activations")
    return spec.resolve_bytes(keep_all_peak_bytes, capacity)


@dataclass(frozen=True)
class StepPlan:
    """A plan of one captured training step and what it predicts."""

    graph: Graph
    plan: Plan
    hardware: Hardware
    executor: str
    keep_all_peak_bytes: int
    budget_bytes: int
    #: The plan simulated on this device's link (instant on the CPU): what the runtime's ledger measures.
    predicted_peak_bytes: int
    #: The plan's step time simulated on `hardware`.
    predicted_step_s: float
    #: (simulated step - the planner's lower bound) / bound, where the planner proves one.
    certified_gap: float | None

    def summary(self) -> str:
        gap = "unknown" if self.certified_gap is None else f"{100 * self.certified_gap:.1f} %"
        counts = {d: sum(1 for v in self.plan.decisions.values() if v == d) for d in set(self.plan.decisions.values())}
        decided = ", ".join(f"{n} {d}" for d, n in sorted(counts.items(), key=lambda kv: str(kv[0])))
        return (f"slackswap: {self.plan.planner} plan ({self.executor}) of {self.graph.name}: {decided}; "
                f"keep-all peak {self.keep_all_peak_bytes} B, budget {self.budget_bytes} B, predicted peak "
                f"{self.predicted_peak_bytes} B; step {1e3 * self.predicted_step_s:.3f} ms on "
                f"{self.hardware.name}, certified gap {gap}")


def plan_step(graph: Graph, model: torch.nn.Module, budget: object, planner: str = "slackswap",
              hardware: Hardware | str | None = None, executor: str = "runtime", certify: bool = False) -> StepPlan:
    """Plan `graph` (captured from `model`) under `budget` with the registered `planner`; for the
    export, inside PyTorch's plan space (`plan_for_export`). A budget the step cannot meet is an
    `IntegrationError` naming it. The certified gap needs a lower bound on the step of any plan: the
    planner's own where it proves one, else with `certify` the `milp` planner's (docs/milp.md; about a
    second on the examples' 2-layer models, minutes on large ones, hence not by default)."""
    from slackswap.experiment.export_plan import plan_for_export
    from slackswap.planners.registry import get_planner
    from slackswap.simulate import simulate
    from slackswap.simulate.metrics import simulate_ideal
    from slackswap.simulate.saved_peak import instant_link

    if executor not in EXECUTORS:
        raise IntegrationError("executor", executor, f"must be one of {', '.join(EXECUTORS)}")
    hardware = hardware_of(hardware)
    keep_all = simulate_ideal(graph, hardware).peak_activation_bytes
    budget_bytes = resolve_budget(budget, keep_all, model)
    chosen = get_planner(planner)
    try:
        if executor == "export":
            plan = plan_for_export(chosen, graph, model, hardware, budget_bytes)
        else:
            plan = chosen.plan(graph, hardware, budget_bytes)
    except InfeasibleBudgetError as exc:
        raise IntegrationError("budget", budget, f"{budget_bytes} B cannot be met by {planner}: {exc}") from None
    sim = simulate(graph, plan, hardware, budget_bytes)
    on_cpu = not any(p.is_cuda for p in model.parameters())
    on_link = simulate(graph, plan, instant_link(hardware) if on_cpu else hardware, None)
    bound = plan.bound_step_s
    if bound is None and certify:
        try:
            bound = get_planner("milp").plan(graph, hardware, budget_bytes).bound_step_s
        except InfeasibleBudgetError:
            bound = None
    gap = (sim.step_s - bound) / bound if bound else None
    return StepPlan(graph, plan, hardware, executor, keep_all, budget_bytes, on_link.peak_activation_bytes,
                    sim.step_s, gap)
