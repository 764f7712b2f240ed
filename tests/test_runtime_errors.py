"""A plan that does not describe the step fails with a named error before any training happens; a
late prefetch makes backward wait and the step stays exact."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.errors import PlanValidationError  # noqa: E402
from slackswap.plan import Decision  # noqa: E402
from slackswap.runtime import PlanMismatchError, apply  # noqa: E402
from slackswap.runtime.copy_engines import CpuCopies  # noqa: E402
from slackswap.runtime.executor import RuntimeUsageError  # noqa: E402
from slackswap.runtime.training_workload import Workload, build_training_workload, small_config  # noqa: E402
from tests.runtime_support import bit_equal, capture, plan_for, run_step, step_under  # noqa: E402

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
        loss, grads = step_under(c.workload, run)
        assert bit_equal(c.reference, loss, grads)
        assert run.report.prefetches == len(plan.prefetches)


def test_nesting_is_a_named_error_not_an_index_error() -> None:
    c = tiny()
    plan, _ = plan_for("slackswap", c)
    outer = apply(plan, c.graph, c.workload.model)
    for p in c.workload.model.parameters():
        p.grad = None
    refused = pytest.raises(RuntimeUsageError, match="another plan run is active.*accumulate=True")
    with refused, outer, apply(plan, c.graph, c.workload.model):
        pass
    # The outer run is usable afterwards: nothing of the refused inner run stayed behind.
    loss, grads, _ = run_step(c.workload, plan, c.graph)
    assert bit_equal(c.reference, loss, grads)


def test_torch_compile_under_the_eager_runtime_points_to_the_export() -> None:
    c = tiny()
    plan, _ = plan_for("keep_all", c)
    compiled = torch.compile(c.workload.model)
    with pytest.raises(RuntimeUsageError, match=r"torch.compile'd.*PlanExport"):
        apply(plan, c.graph, compiled)


def test_changed_code_path_names_the_call_and_the_expected_op() -> None:
    c = tiny()
    plan, _ = plan_for("keep_all", c)
    w = c.workload
    for p in w.model.parameters():
        p.grad = None
    changed = pytest.raises(PlanMismatchError, match=r"not an op of graph.*the plan expected 'op\d+:.*Capture and plan")
    with changed, apply(plan, c.graph, w.model):
        w.loss_fn(w.model(w.batch) * 2).backward()


def test_a_first_forward_that_fills_a_cache_is_named_in_the_refusal() -> None:
    """A model that computes a value once and caches it (BEiT's `lru_cache`'d relative position index)
    runs ops in its first forward, the capture's, that later steps skip: the plan is refused, and the
    refusal names that cause; captured after a warm-up forward, the same model runs exact."""
    import functools

    from slackswap.planners.registry import get_planner
    from slackswap.runtime import capture_graph
    from tests.runtime_support import h200

    @functools.lru_cache(maxsize=1)
    def positions(n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32).sin()

    class Cached(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.fc(x) + positions(x.shape[-1]))

    torch.manual_seed(0)
    model, x = Cached(), torch.randn(4, 8)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.square().sum()

    graph = capture_graph(model, (x,), loss, h200(), name="cached")
    plan = get_planner("keep_all").plan(graph, h200(), None)
    refused = pytest.raises(PlanMismatchError, match=r"computes once and caches.*ran ops later steps skip")
    with refused, apply(plan, graph, model):
        loss(model(x)).backward()
    model.zero_grad(set_to_none=True)
    graph = capture_graph(model, (x,), loss, h200(), name="cached")  # the cache is warm now
    plan = get_planner("keep_all").plan(graph, h200(), None)
    w = Workload("cached", model, x, loss, 8)
    assert bit_equal(step_under(w), *step_under(w, apply(plan, graph, model)))


def test_gradient_accumulation_over_micro_batches_is_bit_exact() -> None:
    """Two micro-batches accumulated under the plan equal two accumulated plain steps, bit for bit."""
    c = tiny()
    plan, _ = plan_for("slackswap", c)
    w = c.workload
    batches = [w.batch, torch.flip(w.batch, dims=[1])]

    def accumulate(with_plan: bool) -> list[torch.Tensor]:
        for p in w.model.parameters():
            p.grad = None
        for i, batch in enumerate(batches):
            torch.manual_seed(10 + i)
            run = apply(plan, c.graph, w.model, accumulate=True) if with_plan else None
            with run if run is not None else contextlib.nullcontext():
                w.loss_fn(w.model(batch)).backward()
        return [p.grad.clone() for p in w.model.parameters()]

    plain, planned = accumulate(False), accumulate(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(plain, c.reference[1], strict=True))  # two batches summed


def test_slow_copies_over_several_steps_reuse_host_buffers_and_stay_exact() -> None:
    """Copies on worker threads after an artificial delay (a slow link), over a verified step and two
    hook-only steps: every unpack waits for its late prefetch, the host buffers are allocated once per
    offload of the plan and reused, and every step is bit-exact."""
    c = tiny()
    plan, _ = plan_for("slackswap", c)
    copies = CpuCopies(delay_s=0.002)
    run = apply(plan, c.graph, c.workload.model, copies=copies)
    for step in range(3):
        loss, grads = step_under(c.workload, run)
        assert bit_equal(c.reference, loss, grads), step
        assert run.report.verified == (step == 0)
        assert run.report.late_prefetch_waits >= 1
    assert copies.host.allocations == len(plan.offloads)
    assert copies.host.bytes == sum(c.graph.tensors[t.tensor].size_bytes for t in plan.offloads)


def test_a_copy_makes_its_consumer_stream_wait_not_the_current_one() -> None:
    """The torchtitan 2581 pitfall: inside `with torch.cuda.stream(s)`, current_stream() is s. The
    engine's copies hold the compute stream and wait on it (CPU stand-ins for stream and event)."""
    from slackswap.runtime.copy_engines import _EventInFlight

    class Stream:
        def __init__(self) -> None:
            self.waited: list[object] = []

        def wait_event(self, event: object) -> None:
            self.waited.append(event)

    compute, event = Stream(), object()
    copy = _EventInFlight(torch.empty(4), event, compute)
    copy.wait()
    assert compute.waited == [event]
