"""A recomputing plan's hook-only steps on a model whose code path changes between steps: refused at the first
module call, autograd node or Python number that differs from the verified step's, or run verified; never a
gradient silently wrong (docs/runtime.md, "Hook-only steps"). A plan that only keeps and moves tensors reads
back what each pack handed over, and stays exact; so does the eager export, which re-runs each layer's forward."""

from __future__ import annotations

import contextlib
import types

import numpy
import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")

from slackswap.plan import Decision, StepKind  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.runtime import apply, capture_graph  # noqa: E402
from slackswap.runtime.executor import PlanMismatchError  # noqa: E402
from slackswap.schedule.build import build_schedule  # noqa: E402
from tests.runtime_support import deterministic_kernels, h200  # noqa: E402, F401 (deterministic_kernels: a fixture)

pytestmark = pytest.mark.usefixtures("deterministic_kernels")


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _recomputing(model, x, name: str, recomputed: str):
    """`model` captured on `x`, every saved tensor whose name holds `recomputed` recomputed and the rest kept,
    and a run of that plan whose first, verified step has run exact."""
    graph = capture_graph(model, (x,), _loss, h200(), name=name)
    decisions = {t.name: Decision.RECOMPUTE if recomputed in t.name else Decision.KEEP for t in graph.saved_tensors}
    assert Decision.RECOMPUTE in decisions.values()
    plan = build_schedule(graph, decisions, planner=f"recompute_{recomputed}", budget_bytes=None, hardware=h200())
    run = apply(plan, graph, model)
    assert _same_step(model, x, run) and run.report.verified
    assert run.report.verified_because == "the first step of a run records what the hook-only steps replay"
    return run


class _LayerDrop(torch.nn.Module):
    """Residual blocks of one shape, the ones in `skip` left out (LayerDrop, set by hand per step)."""

    def __init__(self, layers: int = 4, width: int = 16) -> None:
        super().__init__()
        self.skip: set[int] = {1}
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width))
            for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = x + layer(x)
        return x


def _same_step(model, x, run) -> bool:
    """A plain step and a step under `run`, loss and every gradient (None for a skipped layer's) equal."""
    def grads(context):
        for p in model.parameters():
            p.grad = None
        with context or contextlib.nullcontext():
            loss = _loss(model(x))
            loss.backward()
        return [loss.detach()] + [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    plain, planned = grads(None), grads(run)
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(plain, planned, strict=True))


class _Routed(torch.nn.Module):
    """Each layer sends its whole input to one of two experts of one shape, by a Python choice."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.route = "a"
        def expert() -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                       torch.nn.Linear(2 * width, width))

        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({name: expert() for name in "ab"}) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer[self.route](x)
        return x


class _Branch(torch.nn.Module):
    """An activation chosen by a Python value that is not a number: GELU or SiLU, both functional calls."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.act = "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.nn.functional.gelu(h) if self.act == "gelu" else torch.nn.functional.silu(h)
        return x + self.b(h)


@pytest.mark.parametrize(("make", "recomputed", "attribute", "other", "refusal"), [
    # The layers are called in the same order, their experts not: a recompute of every layer tensor would
    # replay expert a's calls with its weights on expert b's step. Refused at the first module that differs.
    (lambda: _Routed(), "layers", "route", "b",
     r"module call 0 of this step is 'layers\.0\.b\.0'; the verified step called 'layers\.0\.a\.0' there"),
    # The same modules, shapes and packs; only the activation, a functional call, differs: the recompute
    # would replay GELU for a SiLU step. The node that reads a saved tensor back (SiLU's, reading its kept
    # input) is not the verified step's: refused at that unpack. Backward runs in reverse, so the layer
    # above has by then taken the replayed tensor: the step raises instead of returning.
    (lambda: _Branch(), "gelu", "act", "silu",
     r"backward node SiluBackward0 reads back saved tensor \d+ where the verified step's GeluBackward0 did"),
])  # fmt: skip
def test_a_hook_only_step_off_the_recorded_path_is_refused_and_exact_back_on_it(make, recomputed, attribute,
                                                                                  other, refusal) -> None:
    """Before these checks, each such step's gradient was silently wrong."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(32, 16)
    run = _recomputing(model, x, type(model).__name__, recomputed)
    recorded = getattr(model, attribute)
    setattr(model, attribute, other)
    with pytest.raises(PlanMismatchError, match=refusal):
        _same_step(model, x, run)
    setattr(model, attribute, recorded)
    assert _same_step(model, x, run) and not run.report.verified


def test_a_hook_only_step_that_calls_other_layers_is_refused_before_a_recompute_replays_them() -> None:
    """Skipping layer 2 instead of layer 1 packs the same shapes in the same order: a recompute would
    replay layer 1's recorded calls, with its weights, on layer 2's tensors (before this check, a
    silently wrong gradient). A recomputing plan's hook-only step is refused at the first layer that
    differs, before backward (one layer fewer: at the first read back in another order); a plan that only moves
    tensors reads back what each pack handed over, and stays exact; so does the export."""
    torch.manual_seed(0)
    model, x = _LayerDrop(), torch.randn(32, 16)
    graph = capture_graph(model, (x,), _loss, h200(), name="layerdrop")
    recompute = get_planner("full_recompute").plan(graph, h200(), None)
    assert any(s.kind == StepKind.RECOMPUTE for s in recompute.steps)
    run = apply(recompute, graph, model)
    assert _same_step(model, x, run) and run.report.verified
    called = [run.module_calls.paths[i] for i in run.recording.module_calls]
    assert called[:4] == ["layers.0.0", "layers.0.1", "layers.0.2", "layers.2.0"] and len(called) == 9
    model.skip = {2}
    with pytest.raises(PlanMismatchError, match=r"module call 3 of this step is 'layers\.1\.0'; the verified step "
                                                r"called 'layers\.2\.0' there.*eager export"):
        _same_step(model, x, run)
    assert not run.report.verified
    model.skip = {1, 3}
    with pytest.raises(PlanMismatchError, match=r"backward read 'layers\.2\.1/gelu#0:0' where the verified step read "
                                                r"'layers\.3\.1/gelu#0:0'"):  # one layer fewer: the order differs
        _same_step(model, x, run)
    model.skip = {1}
    assert _same_step(model, x, run) and not run.report.verified
    moves = build_schedule(graph, {t.name: Decision.SWAP for t in graph.saved_tensors}, planner="swap_every_tensor",
                           budget_bytes=None, hardware=h200())
    run = apply(moves, graph, model)
    for skip in ({1}, {2}, {0}):
        model.skip = skip
        assert _same_step(model, x, run), skip
    assert not run.report.verified
    # The eager export re-runs each layer's own forward: exact whichever layers a step calls.
    from slackswap.experiment.export_plan import plan_for_export
    from slackswap.runtime.export import PlanExport

    export = PlanExport(plan_for_export(get_planner("full_recompute"), graph, model, h200(), None), graph, model)
    for skip in ({1}, {2}, {1, 3}):
        model.skip = skip
        assert _same_step(model, x, export.installed(model)), skip


class _Annealed(torch.nn.Module):
    """A softmax at a temperature the training loop lowers between steps (Gumbel-softmax annealing)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.temperature = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.softmax(self.a(x) / self.temperature, dim=-1))


def test_a_step_whose_modules_hold_other_numbers_runs_verified_and_records_them_again() -> None:
    """The recorded `div` holds the verified step's temperature, and a hook-only step's recompute replays
    it: before this check, the step after the loop lowered the temperature from 2.0 to 1.5 had a
    gradient silently wrong. Such a step runs verified and its recording replaces the old one, so the
    steps after it at the new temperature run on hooks alone, exact."""
    torch.manual_seed(0)
    model, x = _Annealed(), torch.randn(32, 16)
    run = _recomputing(model, x, "annealed", "softmax")
    verified = [True]
    for temperature in (2.0, 1.5, 1.5, 1.0):
        model.temperature = temperature
        assert _same_step(model, x, run), temperature
        verified.append(run.report.verified)
    assert verified == [True, False, True, False, True]


def test_a_step_after_a_parameter_was_replaced_runs_verified_and_exact() -> None:
    """A recorded call holds a parameter by reference: after the loop swaps in another Parameter object
    (`module.weight = nn.Parameter(...)`), a hook-only recompute would replay the old weight (before: a
    gradient silently wrong). Such a step runs verified and records again; the next one runs on hooks."""
    torch.manual_seed(0)
    model, x = _Annealed(), torch.randn(32, 16)
    run = _recomputing(model, x, "replaced", "softmax")
    assert _same_step(model, x, run) and not run.report.verified
    model.a.weight = torch.nn.Parameter(torch.randn_like(model.a.weight))
    assert _same_step(model, x, run) and run.report.verified
    assert _same_step(model, x, run) and not run.report.verified


#: Temperatures from outside the model, as a training loop may keep them: a module global, an attribute of an
#: imported module and of a global object, and a closure's `nonlocal`.
TEMPERATURE = 2.0
_SETTINGS = types.ModuleType("tempering_settings")
_SETTINGS.TEMPERATURE = 2.0
_OPTIONS = types.SimpleNamespace(temperature=2.0)
_TABLE = {"temperature": 2.0}
_NESTED = types.SimpleNamespace(train=types.SimpleNamespace(temperature=2.0))


def _closure_temperature():
    temperature = 2.0

    def divide(h):
        return h / temperature

    def set_to(value):
        nonlocal temperature
        temperature = value

    return divide, set_to


_divide, _set_closure = _closure_temperature()


def _set_outside(source: str, value: float) -> None:
    global TEMPERATURE
    if source == "global":
        TEMPERATURE = value
    elif source == "module":
        _SETTINGS.TEMPERATURE = value
    elif source == "object":
        _OPTIONS.temperature = value
    elif source == "dict":
        _TABLE["temperature"] = value
    elif source == "nested":
        _NESTED.train.temperature = value
    elif source == "replaced":
        _NESTED.train = types.SimpleNamespace(temperature=value)
    elif source == "class":
        _Tempered.class_temperature = value
    else:
        _set_closure(value)


class _Tempered(torch.nn.Module):
    """A softmax at a temperature read from an argument, a config object or a tensor, as the forward is told."""

    #: A class attribute, read through `self`: another source a loop may set (`_Tempered.class_temperature`).
    class_temperature = 2.0

    def __init__(self, source: str, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.source = source
        self.config = type("Config", (), {})()  # a plain object, as a Hugging Face PretrainedConfig
        self.config.temperature = 2.0

    def forward(self, x: torch.Tensor, temperature: object = 2.0) -> torch.Tensor:
        h = self.a(x)
        temperature = getattr(temperature, "value", temperature)  # an options object holding it
        if self.source == "config":
            temperature = self.config.temperature
        elif self.source == "tensor":
            temperature = h.detach().abs().max().item()
        elif self.source == "numpy":
            temperature = float(h.detach().numpy().max())
        elif self.source == "array":
            temperature = float(numpy.asarray(h.detach()).max())
        elif self.source == "branch" and (x[0, 0] > 0).item():
            h = h * 0.5  # saves nothing: the packs are the same either way
        elif self.source == "global":
            temperature = TEMPERATURE
        elif self.source == "module":
            temperature = _SETTINGS.TEMPERATURE
        elif self.source == "object":
            temperature = _OPTIONS.temperature
        elif self.source == "dict":
            temperature = _TABLE["temperature"]
        elif self.source == "class":
            temperature = self.class_temperature
        elif self.source in ("nested", "replaced"):
            temperature = _NESTED.train.temperature
        elif self.source == "closure":
            return x + self.b(torch.softmax(_divide(h), dim=-1))
        return x + self.b(torch.softmax(h / temperature, dim=-1))


def _steps(model, run, calls) -> list[bool]:
    """Each call's step exact under `run`, and whether it ran verified (after the first, verified step)."""
    verified = []
    for call in calls:
        for p in model.parameters():
            p.grad = None
        plain = _grads(model, call, None)
        assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model, call, run), strict=True))
        verified.append(run.report.verified)
    return verified


def _grads(model, call, context) -> list:
    for p in model.parameters():
        p.grad = None
    with context or contextlib.nullcontext():
        loss = _loss(call())
        loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def test_a_step_called_with_other_python_values_or_config_numbers_runs_verified() -> None:
    """A recorded `div` holds the temperature it was called with; before these checks a hook-only step's
    recompute replayed the verified step's 2.0 for a forward given 1.5 as an argument or through
    `model.config`, silently wrong. Such a step runs verified from its forward pre-hook and records again."""
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    model = _Tempered("argument")
    run = _recomputing(model, x, "argument", "softmax")
    # The verified step was called model(x): the first call with a keyword is another call, verified once.
    assert _steps(model, run, [lambda t=t: model(x, temperature=t) for t in (2.0, 2.0, 1.5, 1.5, 1.0)]) == [
        True, False, True, False, True]
    assert run.report.verified_because.startswith("the model is called with other Python values")
    model = _Tempered("config")
    run = _recomputing(model, x, "config", "softmax")
    calls = []
    for t in (2.0, 1.5):
        calls.append(lambda t=t: (setattr(model.config, "temperature", t), model(x))[1])
    assert _steps(model, run, calls) == [False, True]
    assert run.report.verified_because.startswith("the modules hold other Python numbers")
    assert _steps(model, run, calls[-1:]) == [False] and run.report.verified_because is None


@pytest.mark.parametrize("source", ["global", "module", "object", "dict", "nested", "replaced", "closure", "class"])
def test_a_step_after_a_number_outside_the_model_changed_runs_verified(source) -> None:
    """A recorded `div` holds the temperature the verified step read; before the global reads were recorded
    (`eager.global_reads`), a hook-only step after the loop lowered it replayed 2.0, silently wrong, for a
    module global, an imported module's attribute, a global object's, a global dict's item, an attribute two
    objects down (set in place, or its holder replaced), and a closure's `nonlocal`."""
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    _set_outside(source, 2.0)
    model = _Tempered(source)
    run = _recomputing(model, x, source, "softmax")
    assert run.recording.global_slots  # the forward's read is among them
    calls = []
    for t in (2.0, 1.5, 1.5, 1.0):
        calls.append(lambda t=t: (_set_outside(source, t), model(x))[1])
    # A holder replaced is another object, whatever it holds: every such step runs verified.
    expected = [True] * 4 if source == "replaced" else [False, True, False, True]
    try:
        assert _steps(model, run, calls) == expected
    finally:
        _set_outside(source, 2.0)
    changed = {"global": ".TEMPERATURE", "module": "._SETTINGS.TEMPERATURE", "object": "._OPTIONS.temperature",
               "dict": "._TABLE['temperature']", "nested": "._NESTED.train.temperature", "replaced": "._NESTED.train",
               "closure": "'temperature' of the closure _closure_temperature.<locals>.divide", "class": ""}[source]
    if source == "class":  # a number of the model's own classes: the module checks see it
        assert run.report.verified_because.startswith("the modules hold other Python numbers")
        return
    assert run.report.verified_because == (
        f"a value the forward reads from outside the model changed "
        f"({'' if source == 'closure' else __name__}{changed})")


_COLLECTIONS = 0


def _count_collection(phase: str, info: dict) -> None:
    global _COLLECTIONS
    _COLLECTIONS += 1


def test_a_garbage_collection_in_forward_and_a_tracer_set_before_are_left_alone() -> None:
    """A gc callback runs inside whatever forward a collection interrupts: a global it writes is none of the
    forward's (before it was skipped, every step ran verified); a tracer set before (a debugger, coverage)
    keeps seeing the step's calls and is set again after it."""
    import gc
    import sys

    torch.manual_seed(0)
    x = torch.randn(32, 16)
    model = _Tempered("argument")
    inner = model.forward
    model.forward = lambda *a, **k: (gc.collect(), inner(*a, **k))[1]
    seen: list[str] = []

    def tracer(frame, event, arg):
        seen.append(frame.f_code.co_name)

    gc.callbacks.append(_count_collection)
    sys.settrace(tracer)
    try:
        run = _recomputing(model, x, "collected", "softmax")
        assert _steps(model, run, [lambda: model(x)] * 2) == [False, False]
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
        gc.callbacks.remove(_count_collection)
    assert _COLLECTIONS >= 3 and "forward" in seen


@pytest.mark.parametrize(("source", "read"), [("tensor", "a number (item)"), ("numpy", "an array (numpy)"),
                                              ("array", "an array (numpy)")])
def test_a_forward_that_reads_a_number_from_a_tensor_keeps_every_step_verified(source, read) -> None:
    """Before this, each gave a silently wrong gradient on every hook-only step (`.numpy()` and `__array__`
    until they were seen too). A number or an array read from a tensor before a recomputed call refuses the
    hook-only steps: every step runs verified, exact."""
    torch.manual_seed(0)
    model, x = _Tempered(source), torch.randn(32, 16)
    run = _recomputing(model, x, source, "softmax")
    assert f"read {read} from a tensor before 'op" in run.report.hook_only_refusal
    batches = [torch.randn(32, 16) for _ in range(2)]
    assert _steps(model, run, [lambda b=b: model(b) for b in batches]) == [True, True]
    assert run.report.verified_because.startswith(f"hook-only steps are refused: the model's forward read {read}")


def test_a_forward_that_branches_on_a_tensor_value_is_verified_or_refused_never_replayed() -> None:
    """Before this, it gave a silently wrong gradient on every hook-only step after the branch flipped. A bool
    read is recorded, and a hook-only step that reads another raises in forward, after which the run verifies
    each step (one off the captured graph then refused at its first other call)."""
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    model = _Tempered("branch")
    positive, negative = x.clone(), x.clone()
    positive[0, 0], negative[0, 0] = 1.0, -1.0
    run = _recomputing(model, positive, "branch", "softmax")
    assert run.recording.value_reads == (True,)
    assert _steps(model, run, [lambda: model(positive)]) == [False]
    with pytest.raises(PlanMismatchError, match=r"read a tensor's value as False \(item, read 0 of the step\); the "
                                                r"verified step read True there.*This run verifies its later steps"):
        _grads(model, lambda: model(negative), run)
    with pytest.raises(PlanMismatchError, match=r"ATen call 'op6:aten\.div\.Tensor' is not an op of graph 'branch'"):
        _grads(model, lambda: model(negative), run)  # verified: the captured graph has the branch's mul
    assert _steps(model, run, [lambda: model(positive)] * 2) == [True, True]
    assert run.report.verified_because.startswith("a hook-only step read another tensor value")
    assert torch.Tensor.__dict__.get("item") is None  # the reading methods are PyTorch's again


def test_an_object_argument_runs_every_step_verified() -> None:
    """An argument that is neither a tensor nor a plain value may hold numbers a hook-only step cannot
    compare (here one the loop changes in place): the hook-only steps are refused, every step exact."""
    torch.manual_seed(0)
    model, x = _Tempered("argument"), torch.randn(32, 16)
    options = type("Options", (), {})()
    options.value = 2.0
    graph = capture_graph(model, (x,), _loss, h200(), name="object_argument")
    plan = build_schedule(graph, {t.name: Decision.RECOMPUTE if "softmax" in t.name else Decision.KEEP
                                  for t in graph.saved_tensors}, planner="r", budget_bytes=None, hardware=h200())
    run = apply(plan, graph, model)
    calls = [lambda t=t: (setattr(options, "value", t), model(x, temperature=options))[1] for t in (2.0, 2.0, 1.5)]
    assert _steps(model, run, calls) == [True, True, True]
    assert "the model is called with argument 'temperature' (a Options)" in run.report.hook_only_refusal


@pytest.mark.parametrize("register", [
    lambda model: model.a.register_forward_hook(lambda _m, _i, out: out * 0.5),
    lambda model: model.a.register_forward_pre_hook(lambda _m, args: (args[0] * 0.5,)),
    lambda model: torch.nn.modules.module.register_module_forward_hook(
        lambda m, _i, out: out * 0.5 if m is model.a else None),
])  # fmt: skip
def test_a_step_after_a_forward_hook_was_added_runs_verified(register) -> None:
    """A hook added between steps runs ops in forward that a hook-only recompute would not replay (before: a
    gradient silently wrong). The step runs verified, which refuses it (the captured graph lacks them); with
    the hook removed again the hooks are the recorded step's, and the run is back on hooks, exact."""
    torch.manual_seed(0)
    model, x = _Tempered("argument"), torch.randn(32, 16)
    run = _recomputing(model, x, "hooked", "softmax")
    assert _steps(model, run, [lambda: model(x)]) == [False]
    handle = register(model)
    try:
        with pytest.raises(PlanMismatchError, match=r"ATen call 'op\d+:aten\.mul\.Tensor' is not an op of graph "
                                                    r"'hooked'.*a forward hook"):
            _grads(model, lambda: model(x), run)
    finally:
        handle.remove()
    assert _steps(model, run, [lambda: model(x)] * 2) == [False, False]
