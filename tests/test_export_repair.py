"""The plan made for the export, repaired where every plan the planner made is over the budget as PyTorch's
eager checkpointing runs it (`slackswap.experiment.export_repair`, `slackswap.planners.support.recompute_repair`).

Before, the zoo's Llama at 70 % ran 3 of 16 planners through the export: every swapping planner's plan was
priced 1,189,384 B against a budget of 1,154,412 B at every planning budget tried (the replay reloads a
layer's offloaded tensors at once) while recomputing every decidable tensor priced 960,008 B.
"""

from __future__ import annotations

import pytest

from slackswap.plan import Decision, Plan
from slackswap.planners.support.recompute_repair import movable_groups, moved_decisions, repair_by_recompute

K, S, R = Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE


def test_movable_groups_join_what_one_decision_covers_and_leave_frozen_and_recomputed_groups_out() -> None:
    decisions = {"ln": K, "mean": K, "rstd": K, "mm": S, "fixed": K, "with_fixed": K, "done": R, "cand": K}
    saved = {"ln", "mean", "rstd", "mm", "fixed", "with_fixed", "done"}
    together = [("ln", "mean", "rstd", "ln_out"), ("fixed", "with_fixed")]
    groups = movable_groups(decisions, saved, {"fixed"}, together)
    # ln_out: an undecided candidate of the op, moved with it; "done": nothing left to move; the group
    # holding a frozen tensor stays as it is.
    assert groups == [("cand",), ("ln", "ln_out", "mean", "rstd"), ("mm",)]
    moved = moved_decisions(decisions, [("cand",), ("ln", "ln_out", "mean", "rstd")], saved)
    assert "cand" not in moved and "ln_out" not in moved  # a candidate moved loses its decision
    assert moved["ln"] == moved["mean"] == moved["rstd"] == R and moved["mm"] == S


def test_the_repair_moves_in_order_until_it_fits_then_restores_every_move_the_fit_does_not_need() -> None:
    """Bytes: a 40 (swapped), b 30, c 20, d 10 (kept); over 100 with all of them. The price counts a
    swapped tensor twice (reloaded at once beside the rest): 40*2 + 30 + 20 + 10 = 140 against 95.
    Moving a (60), fits; restoring it does not; the result moves a only."""
    size = {"a": 40, "b": 30, "c": 20, "d": 10}
    plan = Plan(planner="p", budget_bytes=95, decisions={"a": S, "b": K, "c": K, "d": K}, steps=())

    def build(decisions):
        return Plan(planner="p", budget_bytes=95, decisions=decisions, steps=())

    def price(p):
        total = sum(size[t] * {S: 2, K: 1, R: 0}[d] for t, d in p.decisions.items())
        return total if total <= 95 else None

    groups = [("a",), ("b",), ("c",), ("d",)]
    got = repair_by_recompute(plan, groups, set(size), build, price)
    assert got is not None and got.moved == (("a",),) and got.peak_bytes == 60
    assert got.plan.decisions == {"a": R, "b": K, "c": K, "d": K}
    # A tighter budget (45): a leaves 60, a and b 30, and neither comes back (110, 60); nothing fits where
    # the price refuses every plan.
    tight = repair_by_recompute(plan, groups, set(size), build, lambda p: (lambda v: v if v <= 45 else None)(
        sum(size[t] * {S: 2, K: 1, R: 0}[d] for t, d in p.decisions.items())))
    assert tight is not None and tight.moved == (("a",), ("b",)) and tight.peak_bytes == 30
    assert repair_by_recompute(plan, groups, set(size), build, lambda p: None) is None
    # The order is the caller's: smallest first, d, c and b move before a fit (80); d comes back (90), c and
    # b do not (110, 120). Three moves, three restorations tried.
    back = repair_by_recompute(plan, groups[::-1], set(size), build, price)
    assert back is not None and back.moved == (("c",), ("b",)) and back.peak_bytes == 90 and back.pricings == 6


@pytest.mark.slow
def test_llamas_swapping_plan_for_the_export_at_70_percent_is_repaired_and_runs_bit_exact_within_budget() -> None:
    """slackswap on the zoo's Llama at 70 %: refused before (above); now the nearest plan is repaired, named so
    in its notes, executed by the export with every gradient, the loss and the buffers equal to a plain
    step's, priced within the budget as PyTorch runs it. keep_all stays infeasible: a fixed recipe that no
    plan of its own fits."""
    from tests.extras import require_torch_extra

    require_torch_extra("transformers")
    import torch

    from benchmarks.zoo import Arch, compare
    from slackswap.errors import InfeasibleBudgetError
    from slackswap.hardware import load_preset
    from slackswap.runtime.export_facts import export_facts, layer_paths

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        a = Arch("llama", load_preset("a100_80gb_pcie4"), measure=False)
        budget = int(a.peak * 0.7)
        plan = a.plan("slackswap", 0.7, "export")
        notes = plan.notes
        assert notes["export_repaired"] and notes["export_repaired_from_peak_bytes"] > budget
        assert notes["pytorch_peak_bytes"] <= budget
        assert notes["export_repaired_tensors"] and all(
            plan.decisions.get(t, R) == R for t in notes["export_repaired_tensors"])
        facts = export_facts(a.graph, layer_paths(a.pristine))
        assert all(plan.decisions[t] == K for t in facts.fixed_keep)
        assert all(len({plan.decisions[t] for t in group}) == 1 for group in facts.tied)
        assert compare(a.reference, a.run(plan, "export")) == "exact"
        with pytest.raises(InfeasibleBudgetError, match="keeping everything still peaks above it"):
            a.plan("keep_all", 0.7, "export")
    finally:
        torch.use_deterministic_algorithms(deterministic)
