"""The conformance zoo (`benchmarks/zoo.py`): no cell of the runtime executor differs or crashes.

Fast: the in-place patterns and BatchNorm at 70 % under every default planner (the
runtime executor). Slow: every architecture of `slackswap.runtime.zoo` under every default planner at
two of the budgets 30 / 50 / 70 %, the one left out turning with the architecture, so each budget
meets two thirds of the architectures. A cell costs a verified step (0.3-0.7 s on a 2-layer model),
and the whole grid of 28 architectures x 3 budgets (about 100 s of the suite's two workers) is the
benchmark's record, `benchmarks/results/zoo.json`, with the export's cells beside it.
"""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from benchmarks.zoo import DEFAULT_PLANNERS, FACTORIES, kind, run  # noqa: E402
from tests.runtime_support import deterministic_kernels  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.usefixtures("deterministic_kernels")

FAST = ("inplace_attention", "routing", "resnet_bn")


def _failures(result: dict) -> list[str]:
    return [f"{r['model']} {r['planner']} {r['fraction']} {r['executor']}: {r['cell']}" for r in result["cells"]
            if kind(r["cell"]) in ("different", "crash")]


def test_the_fast_zoo_runs_every_planner_exact_or_infeasible_at_70_percent() -> None:
    result = run(FAST, DEFAULT_PLANNERS, (0.7,), ("runtime",), log=lambda _line: None)
    assert not _failures(result), _failures(result)
    kinds = [kind(r["cell"]) for r in result["cells"]]
    assert "refused" not in kinds, [r["cell"] for r in result["cells"] if kind(r["cell"]) == "refused"]
    # Every model has a plan below its keep-all peak that runs exact (most planners do).
    for model in FAST:
        assert any(r["cell"] == "exact" for r in result["cells"] if r["model"] == model), model


BUDGETS = (0.3, 0.5, 0.7)
#: Per architecture, the budgets its test runs: all but one, a different one for consecutive models.
BUDGETS_BY_MODEL = {model: tuple(f for j, f in enumerate(BUDGETS) if j != i % len(BUDGETS))
                    for i, model in enumerate(FACTORIES)}


def test_every_budget_meets_most_architectures() -> None:
    for fraction in BUDGETS:
        met = sum(fraction in fractions for fractions in BUDGETS_BY_MODEL.values())
        assert met >= len(FACTORIES) * 2 // 3, (fraction, met)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(FACTORIES))
def test_every_zoo_architecture_runs_exact_refused_or_infeasible(model: str) -> None:
    result = run((model,), DEFAULT_PLANNERS, BUDGETS_BY_MODEL[model], ("runtime",), log=lambda _line: None)
    assert not _failures(result), _failures(result)
