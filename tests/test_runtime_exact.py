"""Every planner's plan, run for real on CPU: loss and gradients bit for bit equal to a plain step,
recompute and transfer counts equal to the plan's, and the measured ledger of saved bytes equal to
the simulator's peak up to copies the model's own Python variables hold, named one by one."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.graph import GraphMemo  # noqa: E402
from slackswap.planners.registry import available_planners  # noqa: E402
from slackswap.runtime import plan_counts  # noqa: E402
from slackswap.runtime.compare import explain_ledger  # noqa: E402
from slackswap.simulate.saved_peak import simulated_saved_peak_bytes  # noqa: E402
from tests.runtime_support import (  # noqa: E402
    bit_equal,
    capture,
    deterministic_kernels,  # noqa: F401 (a fixture)
    h200,
    plan_for,
    run_step,
    step_under,
)

KINDS = ("tiny", "gpt2", "bert", "llama")
_CAPTURED: dict[str, object] = {}


pytestmark = pytest.mark.usefixtures("deterministic_kernels")


def captured(kind: str):
    if kind not in _CAPTURED:
        _CAPTURED[kind] = capture(kind)
    return _CAPTURED[kind]


#: check_plan_run's results per plan content, kept with the captured graph: a plan two planners share
#: (keep_all's and selective_recompute's here) is run and checked once.
_CHECKED: GraphMemo[dict[tuple, dict]] = GraphMemo(lambda graph: {})


def check_plan_run(c, planner: str, **options: object) -> dict:
    plan, fraction = plan_for(planner, c, **options)
    checked = _CHECKED(c.graph)
    key = plan.schedule_key()
    if key not in checked:
        checked[key] = _check_plan_run(c, plan, planner, fraction)
    return {**checked[key], "plan": plan}


def _check_plan_run(c, plan, planner: str, fraction: float | None) -> dict:
    loss, grads, report = run_step(c.workload, plan, c.graph, trace=True)
    assert bit_equal(c.reference, loss, grads), f"{planner} at {fraction}: loss or a gradient differs"
    counts = plan_counts(plan)
    assert (report.recompute_steps, report.offloads, report.prefetches) == (
        counts["recompute_steps"], counts["offloads"], counts["prefetches"]
    )
    why = explain_ledger(c.graph, plan, report.live_by_step)
    # The run had every copy the plan has, at every step.
    assert why["missing"] == []
    # The plan's own peak is the simulator's (saved bytes only, a link that takes no time).
    assert why["plan_peak_bytes"] == simulated_saved_peak_bytes(c.graph, plan, h200())
    # The ledger's peak is the plan's bytes at that step plus copies the plan had released but some
    # Python variable still held: only run copies, never a copy the runtime made or holds.
    assert report.ledger_peak_bytes == why["plan_bytes_at_ledger_peak"] + why["late_bytes"]
    assert {source for _, source, _ in why["late"]} <= {"run"}
    return {"plan": plan, "report": report, "why": why}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_every_planner_runs_bit_exact(kind: str) -> None:
    c = captured(kind)
    kinds_seen = set()
    for planner in available_planners():
        result = check_plan_run(c, planner)
        plan = result["plan"]
        kinds_seen |= {"swap"} if plan.offloads else set()
        kinds_seen |= {"recompute"} if result["report"].recompute_steps else set()
        if planner == "keep_all":
            # Keep-all: nothing is released early, so the ledger is the simulator's peak to the byte.
            assert result["report"].ledger_peak_bytes == simulated_saved_peak_bytes(c.graph, plan, h200())
    assert kinds_seen == {"swap", "recompute"}, "the planners must exercise both swap and recompute here"
    # slackswap with every swap that hides left in: the plan with the most transfers runs bit-exact too.
    every_hidden = check_plan_run(c, "slackswap", only_needed_swaps=False)["plan"]
    assert len(every_hidden.offloads) >= len(plan_for("slackswap", c)[0].offloads)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3),
    seq=st.sampled_from([4, 8, 12]),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8]),
    layers=st.integers(1, 3),
)
@pytest.mark.slow
def test_small_shapes_bit_exact(batch: int, seq: int, heads: int, head_dim: int, layers: int) -> None:
    c = capture("tiny", batch=batch, seq=seq, heads=heads, hidden=heads * head_dim, layers=layers, vocab=32)
    for planner in ("slackswap", "recompute_knapsack", "capuchin", "full_recompute"):
        check_plan_run(c, planner)


@pytest.mark.parametrize("kind", KINDS)
def test_runtime_names_saved_tensors_as_the_torch_profile_traces_them(kind: str) -> None:
    """The captured graph's saved tensors (identity and bytes) equal the meta-traced graph's (CPU kernels),
    outside the loss (the two use different label tensors)."""
    from slackswap.profile.torch import build_torch_graph
    from slackswap.runtime.training_workload import small_config

    traced = build_torch_graph(*small_config(kind), h200())

    def forward_saved(graph) -> dict[str, int]:
        return {t.name: t.size_bytes for t in graph.saved_tensors if not t.name.startswith("<loss>")}

    assert forward_saved(captured(kind).graph) == forward_saved(traced)


@pytest.mark.parametrize("planner", ["slackswap", "recompute_knapsack"])
def test_plan_of_the_traced_graph_runs_on_the_captured_one(planner: str) -> None:
    """A plan made on the torch profile's meta trace (CPU kernels) runs bit-exact via plan_on_captured."""
    from slackswap.profile.torch import build_torch_graph
    from slackswap.runtime.training_workload import small_config
    from slackswap.runtime.translate import plan_on_captured
    from slackswap.simulate.metrics import simulate_ideal

    c = captured("gpt2")
    traced = build_torch_graph(*small_config("gpt2"), h200())
    budget = int(simulate_ideal(traced, h200()).peak_activation_bytes * 0.8)
    from slackswap.planners.registry import get_planner

    plan = get_planner(planner).plan(traced, h200(), budget)
    # Over its budget on the captured graph, the plan is made again there (tests/test_translate_budget.py).
    runnable = plan_on_captured(plan, traced, c.graph, h200(), planner=get_planner(planner))
    assert dict(runnable.decisions) == dict(plan.decisions) or runnable.notes["replanned_on"] == c.graph.name
    loss, grads, report = run_step(c.workload, runnable, c.graph)
    assert bit_equal(c.reference, loss, grads)
    assert (report.recompute_steps, report.offloads) == (
        plan_counts(runnable)["recompute_steps"], plan_counts(runnable)["offloads"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_hook_only_steps_run_every_planner_bit_exact(kind: str) -> None:
    """The first step under a run is verified (dispatch modes) and records the pack order; the next
    steps run on the saved-tensor hooks alone, and stay bit-exact with the plan's counts."""
    from slackswap.runtime import apply

    c = captured(kind)
    fast_seen = False
    ran = set()  # a plan two planners share runs once
    for planner in available_planners():
        plan, _ = plan_for(planner, c)
        if plan.schedule_key() in ran:
            continue
        ran.add(plan.schedule_key())
        run = apply(plan, c.graph, c.workload.model)
        counts = plan_counts(plan)
        for step in range(3):
            loss, grads = step_under(c.workload, run)
            assert bit_equal(c.reference, loss, grads), (planner, step)
            report = run.report
            assert report.verified == (step == 0 or report.hook_only_refusal is not None), (planner, step)
            assert (report.recompute_steps, report.offloads, report.prefetches) == (
                counts["recompute_steps"], counts["offloads"], counts["prefetches"]), (planner, step)
        fast_seen |= not run.report.verified
        if any(t in c.graph.candidate_names for t in plan.decisions):
            # A kept checkpoint candidate is no saved tensor, so no saved-tensor hook hands it to the
            # recompute that reads it: hook-only steps are refused and every step runs verified
            # (dispatch modes), bit-exact as asserted above (docs/runtime.md).
            assert "a tensor autograd does not save" in (run.recording.refusal or ""), planner
        else:
            assert run.recording.refusal is None, (planner, run.recording.refusal)
    assert fast_seen
