"""The graph a plan for the compiled export is made on: each dropout's mask inside a layer at the bytes
`native_dropout` saves (bool), everything else the captured graph's; and the plan made on it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.extras import require_torch_extra  # noqa: E402

torch = require_torch_extra("torch")

from slackswap.errors import ConfigError  # noqa: E402
from slackswap.experiment.export_plan import export_plan_graph, plan_for_export  # noqa: E402
from slackswap.graph import Tensor  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.runtime.export import PlanExport  # noqa: E402
from slackswap.runtime.export_facts import export_facts, layer_paths, module_path, region_of  # noqa: E402
from slackswap.runtime.export_graph import (  # noqa: E402
    COMPILED_MASKS,
    EXPORT_EXECUTOR,
    compiled_mask_bytes,
    composite_dropouts,
    graph_for_compile,
    priced_for,
)
from slackswap.simulate import simulate  # noqa: E402
from tests.runtime_support import Captured, capture, h200  # noqa: E402

_C: dict[str, Captured] = {}


def tiny() -> Captured:
    if "tiny" not in _C:
        _C["tiny"] = capture("tiny", layers=2)
    return _C["tiny"]


def test_the_compiled_graph_prices_each_layers_dropout_mask_as_bool() -> None:
    """TinyGPT (fp32, dropout in attention, after the projection and after the MLP, and one on the
    embeddings outside every layer): each layer's noise, 4 B per element in CPU eager, is 1 B per element
    on the compiled graph; the embeddings' dropout (not compiled) and every other tensor keep their bytes,
    the ops are the same, and so are the export's facts."""
    c = tiny()
    regions = layer_paths(c.workload.model)
    g = graph_for_compile(c.graph, regions)
    noises = [n for _, n in composite_dropouts(c.graph)]
    inside = [n for n in noises if region_of(module_path(n), regions) is not None]
    assert len(inside) == 3 * len(regions) and len(noises) == len(inside) + 1
    for name, t in c.graph.tensors.items():
        if name in inside:
            assert t.role == "float32" and g.tensors[name].size_bytes * 4 == t.size_bytes, name
            assert g.tensors[name] == replace(t, size_bytes=t.size_bytes // 4)
        else:
            assert g.tensors[name] == t, name
    assert g.ops == c.graph.ops
    assert g.meta[COMPILED_MASKS] == {n: c.graph.tensors[n].size_bytes for n in inside}
    assert graph_for_compile(g, regions) is g  # idempotent
    assert export_facts(g, regions) == export_facts(c.graph, regions)
    assert export_plan_graph(c.graph, c.workload.model, compile=False) is c.graph


def test_the_mask_bytes_come_from_native_dropouts_meta_kernel() -> None:
    """A bf16 noise of 64 B (32 elements) saves a 32 B bool mask; a role that is no dtype is refused."""
    noise = Tensor(name="layers.0/empty_like#0:0", size_bytes=64, producer="op0", consumers=(), layer=0, saved=True,
                   role="bfloat16")
    assert compiled_mask_bytes(noise) == 32
    with pytest.raises(ConfigError, match="not a torch dtype"):
        compiled_mask_bytes(replace(noise, role="dropout_mask"))
    with pytest.raises(ConfigError, match="whole number"):
        compiled_mask_bytes(replace(noise, size_bytes=63))


def test_a_plan_made_for_the_compiled_export_is_priced_on_the_compiled_graph() -> None:
    """plan_for_export(compile=True) plans the compiled graph: its notes say so, PlanExport checks against
    that graph (given the captured one), its kept bytes price each mask at its compiled bytes and its
    simulated peak is within the budget; the eager plan stays on the captured graph. (Its peak is no longer
    compared with the eager plan's: plan_for_export now plans the eager one lower, to fit PyTorch's eager
    replay of it to the budget.)"""
    c = tiny()
    model = c.workload.model
    budget = int(c.keep_all_peak_bytes * 0.9)  # at 0.7 refused: PyTorch's eager replay peaks over it
    eager = plan_for_export(get_planner("slackswap"), c.graph, model, h200(), budget)
    compiled = plan_for_export(get_planner("slackswap"), c.graph, model, h200(), budget, compile=True)
    assert eager.notes[EXPORT_EXECUTOR] == "eager" and compiled.notes[EXPORT_EXECUTOR] == "compile"
    g = export_plan_graph(c.graph, model, compile=True)
    assert PlanExport(compiled, c.graph, model).graph.tensors == g.tensors
    assert PlanExport(eager, c.graph, model).graph is c.graph
    masks = g.meta[COMPILED_MASKS]
    assert all(compiled.decisions[n] == eager.decisions[n] == "keep" for n in masks)  # random: always saved

    def kept(plan, graph) -> int:
        return sum(graph.tensors[n].size_bytes for n, d in plan.decisions.items() if d == "keep")

    assert kept(compiled, g) == kept(compiled, c.graph) - sum(b - g.tensors[n].size_bytes for n, b in masks.items())
    sim = simulate(g, compiled, h200(), budget)
    assert sim.peak_activation_bytes <= budget


def test_a_plan_is_installed_only_on_the_executor_it_was_priced_for() -> None:
    """Where the two executors store a layer's dropout mask at different bytes, a plan made for one
    refuses to be installed on the other, before anything runs, naming both and what to do; also when
    the export is given the graph the plan was made on (the compiled one) instead of the captured one.
    The same decisions priced for the executor (`priced_for`) are installed."""
    from slackswap.runtime.executor import RuntimeUsageError

    c = tiny()
    model = c.workload.model
    budget = int(c.keep_all_peak_bytes * 0.9)
    compiled_graph = export_plan_graph(c.graph, model, compile=True)
    for made, asked, graph in ((True, False, c.graph), (False, True, c.graph), (True, False, compiled_graph)):
        plan = plan_for_export(get_planner("slackswap"), c.graph, model, h200(), budget, compile=made)
        export = PlanExport(plan, graph, model)
        name = {True: "compile", False: "eager"}
        expected = f"made for the {name[made]} export and is installed {name[asked]}"
        with pytest.raises(RuntimeUsageError, match=expected), export.installed(model, compile=asked):
            pass
        assert "forward" not in model.layers[0].__dict__  # nothing was installed
        with PlanExport(priced_for(plan, compile=asked), graph, model).installed(model, compile=asked):
            assert "forward" in model.layers[0].__dict__  # installed
