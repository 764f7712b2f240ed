"""The eager export names, counts, records and audits once: the first step after installation (and any
step with other inputs, or one asked for) runs the plan's policy and leaves each layer's decisions per
ATen call (`CallTable`); the steps after it run from those tables, asking no policy and naming nothing,
bit-exact, with the same decisions. A step whose calls differ from the audited ones is refused."""

from __future__ import annotations

import contextlib

import pytest

from tests.extras import require_torch_extra  # noqa: E402

torch = require_torch_extra("torch")

from slackswap.experiment.export_plan import plan_for_export  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.profile.torch.identity import ModuleStack  # noqa: E402
from slackswap.runtime.export import PlanExport  # noqa: E402
from slackswap.runtime.export.modes import CallsDiffer  # noqa: E402
from slackswap.runtime.export.policy import _RegionPolicy  # noqa: E402
from tests.runtime_support import (  # noqa: E402, F401 (deterministic_kernels: a fixture)
    bit_equal,
    capture,
    deterministic_kernels,
    h200,
    step_under,
)

pytestmark = pytest.mark.usefixtures("deterministic_kernels")

_C: dict = {}


def _exported():
    """TinyGPT (2 layers) and slackswap's plan made for the export at 0.9 of the keep-all peak (the
    tightest it meets: it keeps, swaps and recomputes), installed."""
    if "c" not in _C:
        _C["c"] = capture("tiny", layers=2)
    c = _C["c"]
    plan = plan_for_export(get_planner("slackswap"), c.graph, c.workload.model, h200(),
                           int(c.keep_all_peak_bytes * 0.9))
    return c, PlanExport(plan, c.graph, c.workload.model)


def _tables(export: PlanExport) -> dict:
    return {r: (t.keys, t.kinds) for r in range(len(export.regions)) for t in [export.call_table(r)]}


class _Calls:
    """Counts the calls of the policy (naming, recording) and of the module naming hooks."""

    def __init__(self, monkeypatch):
        self.policy = self.modules = 0
        #: The regions whose policy was asked.
        self.regions: set[int] = set()
        policy, pre = _RegionPolicy.__call__, ModuleStack._pre

        def counted_policy(this, *a, **k):
            self.policy += 1
            self.regions.add(this.region)
            return policy(this, *a, **k)

        def counted_pre(this, *a, **k):
            self.modules += 1
            return pre(this, *a, **k)

        monkeypatch.setattr(_RegionPolicy, "__call__", counted_policy)
        monkeypatch.setattr(ModuleStack, "_pre", counted_pre)


def test_steps_after_the_audited_one_run_from_its_tables_bit_exact_and_with_its_decisions(monkeypatch) -> None:
    c, export = _exported()
    model = c.workload.model
    calls = _Calls(monkeypatch)
    with export.installed(model):
        first = step_under(c.workload)
        assert calls.policy > 0 and calls.modules > 0  # the audited step names every call
        audited, record, differences = _tables(export), export.record, export.step_differences()
        kinds = {k for _, ks in audited.values() for k in ks}
        assert kinds == {"save", "offload", "recompute"}  # the plan keeps, swaps and recomputes
        copies = export.host.copies
        calls.policy = calls.modules = 0
        second = step_under(c.workload)
        assert (calls.policy, calls.modules) == (0, 0)  # no naming, no policy, no module hooks
        assert export.host.copies - copies == copies  # the swaps ran: as many host copies as the first step
        assert export.record is record and export.step_differences() == differences  # the audit kept
        export.audit_next_step()
        third = step_under(c.workload)
        assert calls.policy > 0
        assert _tables(export) == audited  # audited again: the same decisions per call
    for loss, grads in (first, second, third):
        assert bit_equal(c.reference, loss, grads)


def _step(model, batch, context=None) -> tuple:
    """One step on `batch` (whatever its batch size: the workload's loss holds its own targets)."""
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = None
    with context if context is not None else contextlib.nullcontext():
        loss = model(batch).float().logsumexp(-1).mean()
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_step_with_other_input_shapes_is_audited_again(monkeypatch) -> None:
    c, export = _exported()
    model, full = c.workload.model, c.workload.batch
    half = full[:1]
    calls = _Calls(monkeypatch)
    with export.installed(model):
        _step(model, full)
        calls.policy = 0
        exported = _step(model, half)
        assert calls.policy > 0  # other shapes: not run from the tables of the first
        calls.policy = 0
        _step(model, half)
        assert calls.policy == 0  # the same shapes again: from the tables of the step before
        _step(model, full)
        assert calls.policy > 0  # back to the first shapes: audited again (the tables are the last audit's)
    assert bit_equal(_step(model, half), *exported)


@pytest.mark.parametrize("change", ["one more call", "another op at the same position"])
def test_a_layer_whose_calls_differ_is_run_again_audited_and_the_step_stays_exact(monkeypatch, change: str) -> None:
    """A data-dependent path at the same shapes (a mixture of experts routing elsewhere): the layer's
    calls differ from its table, so it runs again audited from the same RNG state; bit-exact against a
    plain step taking the same path, and audited alone at each step until the next audited step."""
    c, export = _exported()
    w = c.workload
    calls = _Calls(monkeypatch)
    ln2 = w.model.layers[0].ln2
    with export.installed(w.model):
        step_under(w)
        record = export.record
        # The same shapes and the same step key: only the calls tell the change.
        ln2.forward = ((lambda x: torch.nn.LayerNorm.forward(ln2, x) * 1.0) if change == "one more call"
                       else torch.nn.functional.gelu)  # one call, as native_layer_norm's
        try:
            calls.regions.clear()
            changed = step_under(w)
            assert calls.regions == {0}  # layer 0 audited again, layer 1 from its table
            assert export.record is record  # the record stays the audited step's
            calls.regions.clear()
            step_under(w)
            assert calls.regions == {0}  # audited alone at each step now
            plain = step_under(w, contextlib.nullcontext())
        finally:
            ln2.__dict__.pop("forward")
        export.audit_next_step()
        step_under(w)
        calls.regions.clear()
        again = step_under(w)
        assert calls.regions == set()  # after a whole audited step, both layers from their tables
    assert bit_equal(plain, *changed)
    assert bit_equal(c.reference, *again)


def test_a_layer_writing_state_it_did_not_make_is_refused_when_its_calls_differ(monkeypatch) -> None:
    """A layer that writes module state (here a counter) cannot run its forward twice: where its calls
    differ from its table the step is refused, and the next step is audited (and exact)."""
    c, export = _exported()
    w = c.workload
    calls = _Calls(monkeypatch)
    ln2, counter = w.model.layers[0].ln2, torch.zeros(1)
    ln2.forward = lambda x: (counter.add_(1), torch.nn.LayerNorm.forward(ln2, x))[1]
    try:
        with export.installed(w.model):
            step_under(w)
            assert export.call_table(0).writes_outside and not export.call_table(1).writes_outside
            ln2.forward = lambda x: (counter.add_(1), torch.nn.LayerNorm.forward(ln2, x) * 1.0)[1]
            with pytest.raises(CallsDiffer, match="audited"):
                step_under(w)
            calls.regions.clear()
            exported = step_under(w)
            assert calls.regions == {0, 1}  # the step after a refusal is audited
        plain = step_under(w)
    finally:
        ln2.__dict__.pop("forward")
    assert bit_equal(plain, *exported)
