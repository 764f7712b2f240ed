"""A plan that does not describe the step fails with a named error before any training happens; a
late prefetch makes backward wait and the step stays exact."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.errors import PlanValidationError  # noqa: E402
from slackswap.plan import Decision  # noqa: E402
from slackswap.runtime import PlanMismatchError, apply  # noqa: E402
from slackswap.runtime.copies import CpuCopies  # noqa: E402
from slackswap.runtime.models import build_training_workload, small_config  # noqa: E402
from tests.runtime_support import bit_equal, capture, plan_for, run_step  # noqa: E402

_C: dict[str, object] = {}


def tiny():
    if "tiny" not in _C:
        _C["tiny"] = capture("tiny", hidden=16, heads=2, seq=8)
    return _C["tiny"]


def no_grads(model: torch.nn.Module) -> bool:
    return all(p.grad is None for p in model.parameters())


def test_plan_for_other_shapes_fails_before_the_forward() -> None:
    c = tiny()
    plan, _ = plan_for("slackswap", c)
    w = c.workload
    other = torch.randint(0, w.vocab_size, (w.batch.shape[0], w.batch.shape[1] * 2))
    for p in w.model.parameters():
        p.grad = None
    mismatch = pytest.raises(PlanMismatchError, match=r"model inputs .* differ from the traced")
    with mismatch, apply(plan, c.graph, w.model):
        w.model(other)
    assert no_grads(w.model)


def test_plan_for_another_model_fails_at_apply() -> None:
    c = tiny()
    plan, _ = plan_for("recompute_knapsack", c)
    wider = build_training_workload(*small_config("tiny", hidden=32, heads=2, seq=8)).model
    with pytest.raises(PlanMismatchError, match="model_signature"):
        apply(plan, c.graph, wider)


def test_graph_from_another_torch_build_fails_at_apply() -> None:
    c = tiny()
    plan, _ = plan_for("slackswap", c)
    graph = replace(c.graph, meta={**c.graph.meta, "torch_version": "1.13.0"})
    with pytest.raises(PlanMismatchError, match="torch_version"):
        apply(plan, graph, c.workload.model)


def test_hand_edited_plan_naming_a_missing_tensor_fails_at_apply() -> None:
    c = tiny()
    plan, _ = plan_for("slackswap", c)
    decisions = {**plan.decisions, "op999:aten.gelu.default/out0": Decision.SWAP}
    with pytest.raises(PlanValidationError, match="op999"):
        apply(replace(plan, decisions=decisions), c.graph, c.workload.model)


def test_unknown_aten_call_is_a_named_error_never_a_silent_keep() -> None:
    """Same shapes, but the model runs in eval mode: dropout's calls are gone, so the ops differ."""
    c = tiny()
    plan, _ = plan_for("slackswap", c)
    w = c.workload
    w.model.eval()
    try:
        with pytest.raises(PlanMismatchError, match="not an op of graph|made tensor|does not list"), apply(
            plan, c.graph, w.model
        ):
            w.loss_fn(w.model(w.batch)).backward()
    finally:
        w.model.train()
    assert no_grads(w.model)


def test_late_prefetch_makes_backward_wait_and_stays_exact() -> None:
    c = tiny()
    plan, _ = plan_for("slackswap", c)
    assert plan.prefetches, "the test needs a plan with swaps"
    loss, grads, report = run_step(c.workload, plan, c.graph, copies=CpuCopies(delay_s=0.02))
    assert report.late_prefetch_waits >= 1
    assert report.prefetches == len(plan.prefetches)
    assert bit_equal(c.reference, loss, grads)


def test_one_plan_run_serves_several_steps() -> None:
    c = tiny()
    plan, _ = plan_for("capuchin", c)
    run = apply(plan, c.graph, c.workload.model)
    for _ in range(2):
        torch.manual_seed(1)
        for p in c.workload.model.parameters():
            p.grad = None
        with run:
            c.workload.loss_fn(c.workload.model(c.workload.batch)).backward()
        grads = [p.grad for p in c.workload.model.parameters() if p.grad is not None]
        assert bit_equal(c.reference, c.reference[0], grads)
        assert run.report.prefetches == len(plan.prefetches)
