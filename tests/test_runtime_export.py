"""A plan exported to PyTorch's selective checkpointing: eager, every planner's plan runs bit-exact and
each decision is executed as planned or named as a difference; compiled (inductor on the CPU), the
partition's saved values are the plan's, read back node by node, and gradients match eager."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest

from tests.extras import require_torch_extra  # noqa: E402

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.errors import InfeasibleBudgetError  # noqa: E402
from slackswap.experiment.export_plan import plan_for_export  # noqa: E402
from slackswap.plan import Decision  # noqa: E402
from slackswap.planners.registry import available_planners, get_planner  # noqa: E402
from slackswap.runtime.export import (  # noqa: E402
    DOES,
    WANTS,
    PlanExport,
    partition_differences,
    recording_backend,
    saved_bytes,
)
from slackswap.runtime.training_workload import build_training_workload, small_config  # noqa: E402
from slackswap.schedule.build import build_schedule  # noqa: E402
from slackswap.simulate.metrics import simulate_ideal  # noqa: E402
from tests.runtime_support import (  # noqa: E402, F401 (deterministic_kernels: a fixture)
    FRACTIONS,
    Captured,
    bit_equal,
    capture,
    deterministic_kernels,
    h200,
    plan_for,
    step_under,
)

_C: dict[str, Captured] = {}


pytestmark = pytest.mark.usefixtures("deterministic_kernels")


def tiny() -> Captured:
    if "tiny" not in _C:
        _C["tiny"] = capture("tiny", layers=2)
    return _C["tiny"]


def exported_step(c: Captured, export: PlanExport, **install: object):
    return step_under(c.workload, export.installed(c.workload.model, **install))


@pytest.mark.slow
def test_eager_export_runs_every_planner_bit_exact_and_names_each_difference() -> None:
    c = tiny()
    acted = set()
    for planner in available_planners():
        plan, _ = plan_for(planner, c)
        export = PlanExport(plan, c.graph, c.workload.model)
        loss, grads = exported_step(c, export)
        assert bit_equal(c.reference, loss, grads), planner
        differences = {d.tensor: d for d in export.step_differences()}
        for d in differences.values():
            assert d.reason and d.exported != WANTS[Decision(d.decision)], d
        # Every decision of a layer not named as a difference ran as planned.
        for decisions in export.region_decisions:
            for name, decision in decisions.items():
                if name not in differences:
                    assert DOES[export.record.applied[name]] == WANTS[decision], (planner, name)
                    acted.add(str(decision))
        swapped = [n for d in export.region_decisions for n, x in d.items() if x == Decision.SWAP
                   and n not in differences]
        assert (export.record.offloaded_bytes > 0) == bool(swapped), planner
    assert acted == {"keep", "swap", "recompute"}


def export_plan_for(planner: str, c: Captured):
    """`plan_for_export` at the tightest of FRACTIONS the planner meets with PyTorch's facts fixed."""
    for fraction in FRACTIONS:
        budget = None if fraction is None else int(c.keep_all_peak_bytes * fraction)
        try:
            return plan_for_export(get_planner(planner), c.graph, c.workload.model, h200(), budget), fraction
        except InfeasibleBudgetError:
            continue
    raise AssertionError(f"{planner} has no plan for the export even without a budget")


@contextmanager
def counted(export: PlanExport, model, **install: object):
    """`installed` inside `counting_saved`: the step's whole saved set is counted (`export.count`)."""
    with export.counting_saved(model) as count, export.installed(model, **install):
        export.count = count
        yield


def test_a_plan_made_for_the_export_runs_as_planned_saving_exactly_the_planned_bytes() -> None:
    """Every planner's plan made for the export (at the tightest budget it meets): no difference, every
    decision executed as planned, bit-exact, and the step saves on the device exactly the bytes the plan
    keeps (checkpoint caches and autograd's, by storage) and offloads exactly the bytes it swaps."""
    c = tiny()
    model = c.workload.model
    acted, fractions = set(), {}
    for planner in available_planners():
        plan, fractions[planner] = export_plan_for(planner, c)
        export = PlanExport(plan, c.graph, model)
        loss, grads = step_under(c.workload, counted(export, model))
        assert bit_equal(c.reference, loss, grads), planner
        assert export.step_differences() == [], planner
        assert export.effective_decisions() == dict(plan.decisions), planner
        size = c.graph.tensors
        kept = sum(size[n].size_bytes for n, d in plan.decisions.items() if d == Decision.KEEP)
        swapped = sum(size[n].size_bytes for n, d in plan.decisions.items() if d == Decision.SWAP)
        assert export.saved_activation_bytes(export.count) == kept, planner
        assert export.record.offloaded_bytes == swapped, planner
        facts = export.facts()
        assert all(plan.decisions[n] == Decision.KEEP for n in facts.fixed_keep), planner
        assert all(len({plan.decisions[n] for n in group}) == 1 for group in facts.tied), planner
        acted.update(str(d) for d in plan.decisions.values())
    assert acted == {"keep", "swap", "recompute"}
    assert fractions["slackswap"] == 0.7  # the benchmark's budget (benchmarks/runtime_overhead.py)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_a_plan_made_for_the_export_of_an_hf_model_saves_exactly_the_planned_bytes(kind: str) -> None:
    """The HF classes (2-layer toy configs): GPT-2's attention mask, made once for all blocks, is a layer
    input autograd does not save; the blocks' checkpoints hold it, so the plan made for the export keeps
    it. The step then saves exactly the plan's kept bytes, bit-exact, with no difference."""
    if kind not in _C:
        _C[kind] = capture(kind, layers=2)
    c = _C[kind]
    model = c.workload.model
    plan, _ = export_plan_for("slackswap", c)
    export = PlanExport(plan, c.graph, model)
    loss, grads = step_under(c.workload, counted(export, model))
    assert bit_equal(c.reference, loss, grads)
    assert export.step_differences() == []
    assert all(plan.decisions[t] == Decision.KEEP for t in export.facts().held_inputs)
    assert bool(export.facts().held_inputs) == (kind == "gpt2")
    kept = sum(c.graph.tensors[n].size_bytes for n, d in plan.decisions.items() if d == Decision.KEEP)
    assert export.saved_activation_bytes(export.count) == kept


def test_the_export_facts_are_what_an_eager_step_executes_otherwise() -> None:
    """A plan that keeps nothing it can drop: every difference the eager step names is a fact known
    before the step (fixed to keep, with the same reason, or tied), and every fixed tensor is one."""
    c = tiny()
    names = [t.name for t in c.graph.saved_tensors]
    plan = build_schedule(c.graph, dict.fromkeys(names, Decision.SWAP), planner="swap", budget_bytes=None,
                          hardware=h200())
    export = PlanExport(plan, c.graph, c.workload.model)
    exported_step(c, export)
    facts = export.facts()
    differences = {d.tensor: d for d in export.step_differences()}
    assert set(differences) == set(facts.fixed_keep) | set(facts.held_inputs)
    assert all(differences[n].reason == reason for n, reason in {**facts.fixed_keep, **facts.held_inputs}.items())
    assert facts.tied, "layer norm's output, mean and rstd share one policy"
    mixed = _mixed_plan(c)
    export = PlanExport(mixed, c.graph, c.workload.model)
    exported_step(c, export)
    tied = {n for group in export.facts().tied for n in group}
    for d in export.step_differences():
        assert d.tensor in export.facts().fixed_keep or d.tensor in tied or d.tensor in export.facts().held_inputs, d


def test_the_export_facts_need_a_captured_graph() -> None:
    from slackswap.errors import ConfigError
    from slackswap.runtime.export_facts import export_facts
    from tests.test_planners import GRAPH

    with pytest.raises(ConfigError, match="capture_graph"):
        export_facts(GRAPH, ["layers.0"])


def test_eager_export_outside_every_layer_is_a_named_difference() -> None:
    c = tiny()
    plan, _ = plan_for("slackswap", c)
    export = PlanExport(plan, c.graph, c.workload.model)
    outside = {d.tensor for d in export.static_differences()}
    assert outside == {n for n, d in plan.decisions.items()
                       if not n.startswith("layers.") and d != Decision.KEEP}
    assert all(d.exported == "saved by autograd" for d in export.static_differences())


def _mixed_plan(c: Captured):
    """Keep / swap / recompute in turn over the layer's saved tensors; everything outside kept."""
    kinds = (Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE)
    names = sorted(t.name for t in c.graph.saved_tensors)
    inside = [n for n in names if n.startswith("layers.")]
    decisions = {n: Decision.KEEP for n in names}
    decisions.update({n: kinds[i % 3] for i, n in enumerate(inside)})
    return build_schedule(c.graph, decisions, planner="mixed", budget_bytes=None, hardware=h200())


@pytest.mark.slow
def test_compiled_partition_against_the_plan_made_for_the_export() -> None:
    """One layer without dropout (inductor's random numbers are not eager's), slackswap's plan made for
    the export: the compiled step's gradients equal eager's to float tolerance; every value the partition
    saves is a planned tensor where the plan puts it (device or host), or a difference naming why; every
    tensor the plan keeps or swaps is saved or named. What stays different is what inductor's
    decompositions read (docs/runtime.md, "The export"): layer norm's normalized input instead of its
    input and mean, rstd / width instead of rstd, GELU's erf + 1. The dropouts of p = 0 trace as clones
    eager never calls; matched by output bytes, every planned identity still has its compiled node."""
    from slackswap.runtime import capture_graph
    from slackswap.runtime.export import DERIVED, HELD_OUTPUT, NOT_READ, RENAMED, UNPLANNED

    model, spec = small_config("tiny", layers=1)
    w = build_training_workload(replace(model, dropout=False), spec)
    graph = capture_graph(w.model, (w.batch,), w.loss_fn, h200(), "tiny-1l")
    torch.manual_seed(1)
    w.loss_fn(w.model(w.batch)).backward()
    reference = [p.grad.clone() for p in w.model.parameters()]
    c = Captured(w, graph, simulate_ideal(graph, h200()).peak_activation_bytes, (None, reference))
    plan, fraction = export_plan_for("slackswap", c)
    assert fraction is not None and plan.offloads
    export = PlanExport(plan, graph, w.model)
    backend, partitions = recording_backend()
    _, grads = exported_step(c, export, compile=True, backend=backend)
    assert len(partitions) == 1  # one compiled backward for the one layer
    for a, b in zip(reference, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    differences = partition_differences(export, partitions)
    named = {d.tensor for d in differences}
    assert {d.reason for d in differences} <= {DERIVED, HELD_OUTPUT, NOT_READ, UNPLANNED}
    assert RENAMED not in {d.reason for d in differences}
    decisions = plan.decisions
    saved = [v for v in partitions[0] if not v.is_input]
    as_planned = [v for v in saved if v.plan_tensor in decisions and v.plan_tensor not in named]
    for v in saved:  # a planned tensor as planned, or named as partition_differences names it
        what = v.plan_tensor or (f"a value inside {v.op}" if v.op else f"compiled value {v.node}")
        assert v in as_planned or what in named, v
    for v in as_planned:
        assert decisions[v.plan_tensor] != Decision.RECOMPUTE and v.offloaded == (
            decisions[v.plan_tensor] == Decision.SWAP), v
    planned = {n for n, d in decisions.items() if n.startswith("layers.") and d != Decision.RECOMPUTE}
    assert planned - {v.plan_tensor for v in as_planned} <= named
    assert any(v.offloaded for v in as_planned), "the swaps must reach torch's offload pass"
    assert any(v.derived_from for v in saved), "layer norm's rstd / width reads back as its rstd"
    device, host = saved_bytes(partitions)
    assert host == sum(v.size_bytes for v in saved if v.offloaded) > 0
    assert device == sum(v.size_bytes for v in saved if not v.offloaded)


@pytest.mark.parametrize("made_for_export", [False, True])
@pytest.mark.parametrize("planner", ["slackswap", "recompute_knapsack"])
def test_the_simulator_runs_pytorchs_execution_of_the_export(planner: str, made_for_export: bool) -> None:
    """The decisions PyTorch executed, rescheduled as PyTorch places them: eager, each layer's
    recomputes in one block before its first backward reader, reloads there; a valid plan the
    simulator prices beside the original. For a plan made for the export the decisions are the plan's."""
    from slackswap.plan import StepKind
    from slackswap.pytorch_execution import pytorch_plan
    from slackswap.simulate import simulate

    c = tiny()
    plan, _ = export_plan_for(planner, c) if made_for_export else plan_for(planner, c)
    export = PlanExport(plan, c.graph, c.workload.model)
    exported_step(c, export)
    effective = export.effective_decisions()
    differ = {d.tensor for d in export.step_differences()}
    assert {n for n in plan.decisions if effective.get(n) != plan.decisions[n]} == differ
    assert (effective == dict(plan.decisions)) == made_for_export
    for mode in ("eager", "compiled"):
        executed = pytorch_plan(c.graph, plan, effective, h200(), mode)
        assert dict(executed.decisions) == effective
        result = simulate(c.graph, executed, h200(), None)
        assert result.step_s > 0
        if mode == "eager":
            layers = [c.graph.tensors[s.outputs[0]].layer for s in executed.steps if s.kind == StepKind.RECOMPUTE]
            blocks = [x for i, x in enumerate(layers) if i == 0 or layers[i - 1] != x]
            assert len(blocks) == len(set(blocks)), "one recompute block per layer"
