"""Numbers from outside the model that change between steps, and state a forward changes: draws from
Python's and NumPy's global generators and from those the modules hold (`slackswap.runtime.host_draws`),
a module number the forward changes, a global list's item and a settings class's attribute
(`eager.global_reads`). A recomputing plan's hook-only step replays the verified step's recorded numbers,
and the export's checkpoint re-runs a layer's forward, so each step runs exact (verified, or from the
state its forward started from), or is refused before its backward runs; before these checks every case
below gave a wrong gradient on hook-only steps or through the export."""

from __future__ import annotations

import contextlib
import pickle
import random

import numpy
import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")

from slackswap.plan import Decision, StepKind  # noqa: E402
from slackswap.runtime import apply, capture_graph  # noqa: E402
from slackswap.runtime.executor import PlanMismatchError  # noqa: E402
from slackswap.schedule.build import build_schedule  # noqa: E402
from tests.runtime_support import deterministic_kernels, h200  # noqa: E402, F401 (deterministic_kernels: a fixture)

pytestmark = pytest.mark.usefixtures("deterministic_kernels")

#: Read as `_SCALES[0]`: a global list's item, one of the global reads' slots.
_SCALES = [2.0]


class _BaseSettings:
    """A class used as a namespace of settings, read through a subclass: `_Settings.temperature`."""

    temperature = 2.0


class _Settings(_BaseSettings):
    pass


class _Drawn(torch.nn.Module):
    """A softmax whose input is scaled by a number the forward draws or reads, as `source` says."""

    def __init__(self, source: str, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.source = source
        self.draw = False  # a module's own number: a step after it changed runs verified
        self.calls = 0
        if source == "own_python":
            self.rng = random.Random(0)
        elif source == "own_numpy":
            self.rng = numpy.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.source == "python":
            h = h * random.choice([0.5, 1.0, 2.0, 3.0])
        elif self.source == "numpy":
            h = h * float(numpy.random.rand())
        elif self.source == "skip" and random.random() < 0.5:
            h = h * 2.0  # saves nothing: the saved tensors are the same either way
        elif self.source == "sometimes":
            h = h * (random.uniform(0.5, 2.0) if self.draw else 1.0)
        elif self.source == "own_python":
            h = h * self.rng.choice([0.5, 1.0, 2.0, 3.0])
        elif self.source == "own_numpy":
            h = h * float(self.rng.random())
        elif self.source == "counter":  # a number of its own the forward changes and reads
            self.calls += 1
            h = h * (1 + 0.1 * self.calls)
        elif self.source == "list":
            h = h / _SCALES[0]
        elif self.source == "class":
            h = h / _Settings.temperature
        return x + self.b(torch.softmax(h, dim=-1))


def _grads(model, x, context, seed: int) -> list:
    """One step from `seed` in every generator (the plain and the planned step draw the same numbers)."""
    random.seed(seed)
    numpy.random.seed(seed)
    for module in model.modules():  # the generators the modules hold: their state set, the objects kept
        if isinstance(getattr(module, "rng", None), random.Random):
            module.rng.seed(seed)
        elif isinstance(getattr(module, "rng", None), numpy.random.Generator):
            module.rng.bit_generator.state = numpy.random.default_rng(seed).bit_generator.state
    for p in model.parameters():
        p.grad = None
    with context or contextlib.nullcontext():
        loss = model(x).square().mean()
        loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def _run(source: str):
    """The model, its batch and a run of a plan that recomputes the softmax."""
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    model = _Drawn(source)
    graph = capture_graph(model, (x,), lambda out: out.square().mean(), h200(), name=source)
    decisions = {t.name: Decision.RECOMPUTE if "softmax" in t.name else Decision.KEEP for t in graph.saved_tensors}
    plan = build_schedule(graph, decisions, planner="recompute_softmax", budget_bytes=None, hardware=h200())
    return model, x, apply(plan, graph, model)


def _step(model, x, run, seed: int) -> str:
    """'verified' or 'hook-only' for an exact step (a differing one fails the test), 'refused' for a refusal."""
    plain = _grads(model, x, None, seed)
    try:
        planned = _grads(model, x, run, seed)
    except PlanMismatchError:
        return "refused"
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True)), seed
    return "verified" if run.report.verified else "hook-only"


@pytest.mark.parametrize("source, drawn", [("python", "Python's random module"),
                                           ("numpy", "NumPy's global generator (numpy.random)"),
                                           ("own_python", "the model's own generator rng (Random)"),
                                           ("own_numpy", "the model's own generator rng (Generator)")])
def test_a_forward_that_draws_from_a_python_or_numpy_generator_runs_every_step_verified(source, drawn) -> None:
    model, x, run = _run(source)
    assert [_step(model, x, run, seed) for seed in range(4)] == ["verified"] * 4
    assert run.recording.refusal == (f"the model's forward draws from {drawn}: a recompute on hooks alone would "
                                     "replay the verified step's numbers")
    assert run.report.verified_because.startswith("hook-only steps are refused: the model's forward draws from")


def test_a_generator_the_module_was_given_after_the_run_was_made_is_the_one_read() -> None:
    """The generator objects are found where each verified step begins, not when the run is made: read
    from the run's making, a replaced one's draws went unseen and the hook-only steps replayed them."""
    model, x, run = _run("own_numpy")
    model.rng = numpy.random.default_rng(1)
    assert [_step(model, x, run, seed) for seed in range(3)] == ["verified"] * 3
    assert run.recording.refusal.startswith("the model's forward draws from the model's own generator rng")


def test_a_layer_skipped_on_a_python_draw_is_exact_or_refused() -> None:
    """The skipped `mul` saves nothing: on hooks alone the step saved the same tensors and replayed the
    recorded path. Verified, each step's calls are checked against the captured graph."""
    model, x, run = _run("skip")
    outcomes = [_step(model, x, run, seed) for seed in range(8)]
    assert set(outcomes) == {"verified", "refused"}, outcomes


def test_a_forward_that_starts_drawing_runs_verified_and_refuses_the_hook_only_steps_from_then() -> None:
    """The verified step's forward drew nothing, so the steps after it ran on hooks alone; the switch that
    makes a later forward draw is a module's number, so that step runs verified, and its draw refuses the
    hook-only steps: every step after it runs verified."""
    model, x, run = _run("sometimes")
    assert [_step(model, x, run, seed) for seed in range(2)] == ["verified", "hook-only"]
    assert run.recording.refusal is None
    model.draw = True
    assert [_step(model, x, run, seed) for seed in range(2, 5)] == ["verified"] * 3
    assert run.recording.refusal.startswith("the model's forward draws from Python's random module")


def _set_scale(source: str, value: float) -> None:
    if source == "list":
        _SCALES[0] = value
    elif source == "base":
        _BaseSettings.temperature = value
    elif value != 2.0:  # set on the subclass: shadows the base's
        _Settings.temperature = value
    elif "temperature" in vars(_Settings):  # back to the base's
        del _Settings.temperature


@pytest.mark.parametrize("source, name", [("list", "_SCALES[0]"), ("class", "_Settings.temperature"),
                                          ("base", "_Settings.temperature")])
def test_a_step_after_a_global_lists_item_or_a_classs_attribute_changed_runs_verified(source, name) -> None:
    _set_scale(source, 2.0)
    model, x, run = _run("list" if source == "list" else "class")
    try:
        assert [_step(model, x, run, seed) for seed in range(2)] == ["verified", "hook-only"]
        _set_scale(source, 1.5)
        assert _step(model, x, run, 2) == "verified"
        assert run.report.verified_because == (
            f"a value the forward reads from outside the model changed ({__name__}.{name})")
        assert _step(model, x, run, 3) == "hook-only"
    finally:
        _set_scale(source, 2.0)


class _Layers(torch.nn.Module):
    """Three blocks in a `ModuleList` (the export's checkpoint regions), each scaling by a draw as `source`
    says before its softmax."""

    def __init__(self, source: str, width: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Drawn(source, width) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("source", ["python", "numpy", "own_python", "own_numpy", "counter", "none"])
def test_the_eager_export_recomputes_a_layer_from_what_its_forward_started_from(source) -> None:
    """checkpoint restores torch's generators for the recompute and nothing else: before, full_recompute
    through the eager export was wrong on every step of a layer that draws or counts its calls in forward
    (and the count ran twice as fast)."""
    import copy

    from slackswap.experiment.export_plan import plan_for_export
    from slackswap.planners.registry import get_planner
    from slackswap.runtime.export import PlanExport
    from slackswap.simulate.metrics import simulate_ideal

    torch.manual_seed(0)
    x, model = torch.randn(256, 64), _Layers(source)
    graph = capture_graph(copy.deepcopy(model), (x,), lambda out: out.square().mean(), h200(), name=source)
    budget = int(simulate_ideal(graph, h200()).peak_activation_bytes * 0.97)
    plan = plan_for_export(get_planner("full_recompute"), graph, model, h200(), budget)
    assert any(s.kind == StepKind.RECOMPUTE and "softmax" in s.op for s in plan.steps)
    plain, exported = copy.deepcopy(model), copy.deepcopy(model)
    export = PlanExport(plan, graph, exported)
    with export.installed(exported):
        if source == "own_numpy":  # given after the installation: the one its recompute restores
            for layer in (*plain.layers, *exported.layers):
                layer.rng = numpy.random.default_rng(3)
        for seed in range(3):  # the first step audited, then steady steps
            expected = _grads(plain, x, None, seed)
            assert all(torch.equal(a, b) for a, b in zip(expected, _grads(exported, x, None, seed), strict=True))
    assert export.replayed.drawing == ({0, 1, 2} if source not in ("counter", "none") else set())
    assert export.replayed.changing == ({0, 1, 2} if source == "counter" else set())
    assert [layer.calls for layer in exported.layers] == [layer.calls for layer in plain.layers]


def test_the_compiled_export_refuses_a_layer_that_draws_before_its_backward() -> None:
    """The compiled recompute is torch's and draws again (measured: gradients 1.8e-4 to 5.2e-4 off where the
    same compiled step without draws is 5.6e-9 off eager); the first call after installation is read."""
    from slackswap.runtime.errors import RuntimeUsageError
    from slackswap.runtime.export.replayed_state import ReplayedState

    calls = []
    quiet = ReplayedState.refused_when_drawing("layers.0", torch.nn.Identity(), lambda: calls.append(1))
    quiet(), quiet()
    drawing = ReplayedState.refused_when_drawing("layers.1", torch.nn.Identity(), lambda: numpy.random.rand())
    with pytest.raises(RuntimeUsageError, match="layer 'layers.1' draws from NumPy's global generator"):
        drawing()
    assert calls == [1, 1]
    holder = _Drawn("own_python")
    own = ReplayedState.refused_when_drawing("layers.2", holder, lambda: holder.rng.random())
    with pytest.raises(RuntimeUsageError, match="layer 'layers.2' draws from the model's own generator rng"):
        own()


def test_a_capture_leaves_pythons_numpys_and_the_modules_generators_where_they_were() -> None:
    """capture_graph promises not to move the caller's RNG streams: torch's under fork_rng, and these put back."""
    for source in ("python", "numpy", "own_numpy"):
        model, x = _Drawn(source), torch.randn(32, 16)
        random.seed(5)
        numpy.random.seed(5)
        before = (random.getstate(), pickle.dumps(numpy.random.get_state()),
                  pickle.dumps(getattr(model, "rng", None) and model.rng.bit_generator.state))
        capture_graph(model, (x,), lambda out: out.square().mean(), h200(), name=source)
        after = (random.getstate(), pickle.dumps(numpy.random.get_state()),
                 pickle.dumps(getattr(model, "rng", None) and model.rng.bit_generator.state))
        assert after == before, source
