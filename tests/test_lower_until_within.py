"""`lower_until_within`, the replan loop DTR and plans with tensors fixed to keep share: each round
lowers the inner budget by the replayed excess, and it stops when the plan fits, when the inner
budget would reach zero, or after `max_rounds` more rounds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slackswap.planners.support import budget_check


@pytest.mark.parametrize(
    ("peaks", "max_rounds", "inner_budgets", "returned_peak"),
    [
        ((90,), 4, [100], 90),  # fits at once
        ((130, 110, 95), 4, [100, 70, 60], 95),  # lowered by 30, then by 10, then fits
        ((130, 130, 130), 2, [100, 70, 40], 130),  # out of rounds: the last plan and its peak
        ((160, 150), 4, [100, 40], 150),  # 40 - 50 would be <= 0: stops there
    ],
)
def test_each_round_lowers_the_inner_budget_by_the_excess(monkeypatch, peaks, max_rounds, inner_budgets,
                                                         returned_peak) -> None:
    asked: list[int] = []
    by_plan = {}

    def plan_at(round_: int, inner: int):
        assert round_ == len(asked)
        asked.append(inner)
        plan = SimpleNamespace(round=round_)
        by_plan[id(plan)] = peaks[round_]
        return plan

    monkeypatch.setattr(budget_check, "estimate_plan",
                        lambda graph, plan, hardware: SimpleNamespace(peak_bytes=by_plan[id(plan)]))
    plan, peak, rounds = budget_check.lower_until_within(None, None, 100, max_rounds, plan_at)
    assert asked == inner_budgets
    assert (peak, rounds, plan.round) == (returned_peak, len(inner_budgets), len(inner_budgets) - 1)
