"""A plan moved from the traced graph to the captured one is re-checked against its budget (issue 39,
item 5): the captured step holds the weight gradients to its end and runs the decisions at other
positions, so the same decisions can peak above the budget there. Over it, the plan is made again on
the captured graph (with a planner) or refused with both peaks; before, it ran over silently."""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.errors import InfeasibleBudgetError  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.profile.torch import build_torch_graph  # noqa: E402
from slackswap.runtime.training_workload import small_config  # noqa: E402
from slackswap.runtime.translate import plan_on_captured  # noqa: E402
from slackswap.schedule.replay import estimate_plan  # noqa: E402
from slackswap.simulate.metrics import simulate_ideal  # noqa: E402
from tests.runtime_support import capture, h200  # noqa: E402


@pytest.fixture(scope="module")
def graphs():
    c = capture("gpt2", layers=2)
    traced = build_torch_graph(*small_config("gpt2"), h200())
    return c, traced


def test_a_translated_plan_over_its_budget_is_refused_or_made_again_on_the_captured_graph(graphs) -> None:
    c, traced = graphs
    budget = int(simulate_ideal(traced, h200()).peak_activation_bytes * 0.5)
    plan = get_planner("slackswap").plan(traced, h200(), budget)
    with pytest.raises(InfeasibleBudgetError, match=r"on the captured graph .*over its budget .* by \d+\.\d %"):
        plan_on_captured(plan, traced, c.graph, h200())
    try:
        replanned = plan_on_captured(plan, traced, c.graph, h200(), planner=get_planner("slackswap"))
    except InfeasibleBudgetError as exc:  # refused: the planner's own reason on the captured graph
        assert "slackswap" in str(exc)
    else:
        assert replanned.notes["replanned_on"] == c.graph.name
        assert replanned.notes["translated_peak_bytes"] > budget
        assert estimate_plan(c.graph, replanned, h200()).peak_bytes <= budget


def test_a_translated_plan_within_its_budget_keeps_its_decisions(graphs) -> None:
    c, traced = graphs
    plan = get_planner("slackswap").plan(traced, h200(), None)
    moved = plan_on_captured(plan, traced, c.graph, h200())
    assert dict(moved.decisions) == dict(plan.decisions) and "replanned_on" not in moved.notes
