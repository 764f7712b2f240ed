"""The export's gradients equal eager's (issue 39, item 3): a tensor a later in-place op overwrites
(Mixtral's router: topk, sum, div_ into topk's values) is cached by the checkpoint at its last version,
so an op that read an earlier version is saved, never recomputed from the overwritten one."""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")

from slackswap.experiment.export_plan import plan_for_export  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.runtime.export import PlanExport  # noqa: E402
from slackswap.runtime.export_facts import VERSION_READ  # noqa: E402
from tests.export_models import Router, hf_causal_lm, stack  # noqa: E402
from tests.runtime_support import (  # noqa: E402, F401 (deterministic_kernels: a fixture)
    bit_equal,
    deterministic_kernels,
    h200,
    step_under,
)

pytestmark = pytest.mark.usefixtures("deterministic_kernels")


def _exported(c, planner: str, budget_bytes: int | None = None, plan=None):
    model = c.workload.model
    plan = plan or plan_for_export(get_planner(planner), c.graph, model, h200(), budget_bytes)
    export = PlanExport(plan, c.graph, model)
    loss, grads = step_under(c.workload, export.installed(model))
    return export, loss, grads


@pytest.mark.parametrize("planner", ["full_recompute", "torch_sac", "slackswap"])
def test_an_op_that_read_a_version_later_overwritten_is_saved_and_the_step_is_bit_exact(planner: str) -> None:
    c = stack(Router)
    export, loss, grads = _exported(c, planner)
    assert bit_equal(c.reference, loss, grads), planner
    readers = export.facts().version_readers
    assert {"layers.0/sum#0:0", "layers.1/sum#0:0"} <= readers, readers  # the divisor read topk's values
    assert {n for n, why in export.facts().fixed_keep.items() if why == VERSION_READ} <= readers
    assert export.step_differences() == []


def test_a_plan_not_made_for_the_export_names_the_saved_reader() -> None:
    c = stack(Router)
    plan = get_planner("full_recompute").plan(c.graph, h200(), None)
    export, loss, grads = _exported(c, "full_recompute", plan=plan)
    assert bit_equal(c.reference, loss, grads)
    named = {d.tensor for d in export.step_differences() if d.reason == VERSION_READ}
    assert named and named <= export.facts().version_readers


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("planner", ["full_recompute", "torch_sac"])
def test_mixtral_exported_gradients_equal_eager(planner: str, dtype: str) -> None:
    """17 of 21 gradients differed before (issue 39), while `step_differences()` was empty."""
    c = hf_causal_lm("MixtralConfig", dtype=getattr(torch, dtype), num_local_experts=4)
    export, loss, grads = _exported(c, planner)
    assert bit_equal(c.reference, loss, grads)
    assert export.step_differences() == []
