"""The conformance zoo (`benchmarks/zoo.py`): no cell of the runtime executor differs or crashes.

Fast: the in-place patterns and BatchNorm at 70 % under every default planner (the
runtime executor). Slow: every architecture of `slackswap.runtime.zoo` under every default planner at
one of the budgets 70 / 50 / 30 %, turning with the architecture, so each budget meets a third of the
architectures (the suite's time is its limit: with two budgets each, this file took 58.6 s of worker time).
A cell costs a verified step (0.3-0.7 s on a 2-layer model), and the whole grid of 34 architectures x
3 budgets x both executors is the benchmark's record, `benchmarks/results/zoo.json`, which fails on
any cell that differs, crashes or measures over its budget. The export's
measure: a swapping plan's measured peak is its price, and a step measured over its budget fails the zoo.
"""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from benchmarks.zoo import DEFAULT_PLANNERS, FACTORIES, kind, run  # noqa: E402
from tests.runtime_support import deterministic_kernels, one_thread  # noqa: E402, F401 (fixtures)

pytestmark = pytest.mark.usefixtures("deterministic_kernels")

FAST = ("inplace_attention", "routing", "resnet_bn")


def _failures(result: dict) -> list[str]:
    return [f"{r['model']} {r['planner']} {r['fraction']} {r['executor']}: {r['cell']}" for r in result["cells"]
            if kind(r["cell"]) in ("different", "crash")]


@pytest.fixture(scope="module")
def archs() -> dict:
    """The architectures captured by this module's tests, by name: a model two tests run is captured once,
    and a cell two tests ask for (the same plan on the same executor) runs once."""
    return {}


def test_the_fast_zoo_runs_every_planner_exact_or_infeasible_at_70_percent(archs, monkeypatch) -> None:
    from benchmarks import zoo

    ran = []
    run_plan = zoo.Arch.run
    monkeypatch.setattr(zoo.Arch, "run", lambda self, plan, executor: ran.append(plan) or run_plan(self, plan,
                                                                                                    executor))
    result = run(FAST, DEFAULT_PLANNERS, (0.7,), ("runtime",), log=lambda _line: None, archs=archs)
    assert not _failures(result), _failures(result)
    # A plan equal to one already run on the model (keep_all's and swap_only's, often) is not run again.
    planned = sum(kind(r["cell"]) not in ("infeasible", "crash") for r in result["cells"])
    assert len({(p.schedule_key(), p.budget_bytes) for p in ran}) == len(ran) < planned, (len(ran), planned)
    kinds = [kind(r["cell"]) for r in result["cells"]]
    assert "refused" not in kinds, [r["cell"] for r in result["cells"] if kind(r["cell"]) == "refused"]
    # Every model has a plan below its keep-all peak that runs exact (most planners do).
    for model in FAST:
        assert any(r["cell"] == "exact" for r in result["cells"] if r["model"] == model), model


BUDGETS = (0.7, 0.5, 0.3)
#: Per architecture, the budget its test runs: a different one for consecutive models.
BUDGETS_BY_MODEL = {model: (BUDGETS[i % len(BUDGETS)],) for i, model in enumerate(FACTORIES)}


def test_every_budget_meets_most_architectures() -> None:
    for fraction in BUDGETS:
        met = sum(fraction in fractions for fractions in BUDGETS_BY_MODEL.values())
        assert met >= len(FACTORIES) // 3, (fraction, met)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(FACTORIES))
def test_every_zoo_architecture_runs_exact_refused_or_infeasible(model: str, archs) -> None:
    result = run((model,), DEFAULT_PLANNERS, BUDGETS_BY_MODEL[model], ("runtime",), log=lambda _line: None,
                 archs=archs)
    assert not _failures(result), _failures(result)


def test_trace_vs_hooks_names_every_tensor_one_side_lacks_and_every_byte_difference() -> None:
    from types import SimpleNamespace

    from benchmarks.zoo import trace_vs_hooks

    def graph(saved: dict[str, int], never_read=()):
        return SimpleNamespace(saved_tensors=[SimpleNamespace(name=n, size_bytes=b) for n, b in saved.items()],
                               meta={"packed_never_read": list(never_read)})

    assert trace_vs_hooks({"a": 4, "b": 8}, graph({"b": 8, "a": 4})) == "same: 2 tensors, 12 B"
    got = trace_vs_hooks({"a": 4, "gate": 8, "t": 2, "r": 16}, graph({"a": 4, "h": 1, "r": 32}, ["gate"]))
    assert got.startswith("differs: trace 4 tensors 30 B, hooks 3 tensors 37 B;")
    assert "packed for a node backward never ran (the capture frees it with the node): gate (8 B)" in got
    assert "saved by the trace only: t (2 B)" in got and "seen by the hooks only: h (1 B)" in got
    assert "bytes differ: r (trace 16 B, hooks 32 B)" in got


def test_the_zoo_compares_the_trace_with_the_hooks_per_architecture(archs) -> None:
    """Routing's router logits die after argsort, so the node that packed each layer's input never runs
    backward: the hooks' capture frees them, the trace holds them (named); ResNet's saved tensors agree."""
    result = run(("routing", "resnet_bn"), ("keep_all",), (0.7,), ("runtime",), log=lambda _line: None,
                 trace=True, archs=archs)
    assert result["saved"]["resnet_bn"].startswith("same: ")
    routing = result["saved"]["routing"]
    assert routing.startswith("differs: ") and "layers.0/add#0:0 (32768 B)" in routing
    assert "packed for a node backward never ran" in routing


def _swaps(plan) -> int:
    from slackswap.plan import Decision

    return sum(d == Decision.SWAP for d in plan.decisions.values())


@pytest.mark.usefixtures("one_thread")
def test_an_exported_swap_plans_measured_peak_is_its_price_to_the_byte() -> None:
    """The tied MLP stack's capuchin plan at 70 % (20 tensors offloaded), measured as the zoo measures (the
    step after the one that allocates the host buffers, so the CPU allocator sees device bytes only): the
    CPU peak less the
    checkpoints' RNG state and the largest weight gradient in flight is the plan's price, to the byte. The
    offloads are what keeps it there: the same decisions with every swap kept measure higher. Before the
    export's CPU offload copied into a host buffer and reloaded into a new tensor, its host copy was a
    CPU allocation held to the end of the backward, and a swap plan could not be measured at all."""
    from dataclasses import replace

    from benchmarks.runtime_overhead_measures import peak_cpu_bytes
    from benchmarks.zoo import HARDWARE, Arch, measure_export_peak
    from slackswap.hardware import load_preset
    from slackswap.plan import Decision
    from slackswap.runtime.export import PlanExport

    arch = Arch("tied", load_preset(HARDWARE))
    plan = arch.plan("capuchin", 0.7, "export")
    assert _swaps(plan) > 0
    measured, rng, in_flight = measure_export_peak(plan, arch.graph, arch.pristine, arch.w, peak_cpu_bytes,
                                                   PlanExport)
    assert measured - rng - in_flight == plan.notes["pytorch_peak_bytes"] <= int(arch.peak * 0.7)
    kept = replace(plan, decisions={n: Decision.KEEP if d == Decision.SWAP else d for n, d in plan.decisions.items()})
    measured_kept, _, _ = measure_export_peak(kept, arch.graph, arch.pristine, arch.w, peak_cpu_bytes, PlanExport)
    assert measured_kept > measured, (measured_kept, measured)


@pytest.mark.usefixtures("one_thread")
def test_an_exported_step_measured_over_its_budget_is_a_failure(monkeypatch, tmp_path) -> None:
    """A swapping plan made for 70 % of the tied stack's keep-all peak, run as the cell of a 30 % budget: the
    gradients are exact, the measured peak is not within the budget, and the zoo says so and fails."""
    import json

    from benchmarks import zoo

    made_for = zoo.Arch.plan

    def plan_at_70(self, planner: str, fraction: float, executor: str):
        plan = made_for(self, planner, 0.7, executor)
        assert _swaps(plan) > 0
        return plan

    monkeypatch.setattr(zoo.Arch, "plan", plan_at_70)
    out = tmp_path / "zoo.json"
    code = zoo.main(["--models", "tied", "--planners", "capuchin", "--fractions", "0.3", "--executors", "export",
                     "--no-trace", "--out", str(out)])
    assert code == 1
    cell = json.loads(out.read_text())["matrix"]["tied"]["capuchin"]["30% export"]
    assert cell.startswith("over budget: measured "), cell


def test_the_extra_architectures_build_apart_from_the_tested_ones(tmp_path, monkeypatch) -> None:
    """`EXTRA_FACTORIES` (run once, `--extra`) share no name with the tested `FACTORIES`; `build` and the
    zoo command take either, and `--extra` writes its own record."""
    import json

    from benchmarks import zoo
    from slackswap.runtime.zoo import EXTRA_FACTORIES, FACTORIES, build

    assert EXTRA_FACTORIES and not set(EXTRA_FACTORIES) & set(FACTORIES)
    with pytest.raises(KeyError, match="olmo2"):
        build("no_such_model")
    monkeypatch.setattr(zoo, "RESULTS", tmp_path)
    assert zoo.main(["--extra", "--models", "olmo2", "--planners", "keep_all", "--fractions", "1",
                     "--executors", "runtime", "--no-trace"]) == 0
    matrix = json.loads((tmp_path / "zoo_extra.json").read_text())["matrix"]
    assert matrix["olmo2"]["keep_all"]["100% runtime"] == "exact"
    assert zoo.main(["--models", "no_such_model"]) == 2
