"""Planning with saved tensors fixed to keep (slackswap.planners.support.fixed_keep), no torch: the derived
graph costs, copy for copy, what the original graph with those tensors kept costs; every planner's plan
maps back with them kept, within the budget, or the planner's reason is raised."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import FORWARD_PHASES
from slackswap.plan import Decision, StepKind
from slackswap.planners.registry import available_planners, get_planner
from slackswap.planners.support.fixed_keep import UNREAD_SWAP, graph_with_fixed_keep, plan_with_fixed_keep
from slackswap.schedule.build import build_schedule
from slackswap.schedule.replay import estimate_plan
from slackswap.simulate import simulate
from slackswap.simulate.metrics import simulate_ideal
from slackswap.testing import bwd, fwd, make_graph, random_decisions, random_graph, toy_hardware
from tests.test_planners import GRAPH, HW, PEAK

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _forward_saved(graph):
    return [t.name for t in graph.saved_tensors if graph.op_by_name[t.producer].phase in FORWARD_PHASES]


@SETTINGS
@given(st.randoms(use_true_random=False))
def test_a_fixed_tensor_costs_exactly_what_a_kept_saved_tensor_costs(rng: random.Random) -> None:
    """The same decisions, the fixed tensors kept on the original graph and undecidable on the derived
    one: the same steps, and the simulator's peak, memory curve and step time equal to the byte."""
    graph = random_graph(rng, max_layers=5, max_size_bytes=1000, real_program=True, in_place=True,
                         held=rng.random() < 0.5)
    candidates = _forward_saved(graph)
    fixed = set(rng.sample(candidates, rng.randint(0, len(candidates))))
    decisions = random_decisions(graph, rng)
    kept = {n: (Decision.KEEP if n in fixed else d) for n, d in decisions.items()}
    derived = graph_with_fixed_keep(graph, fixed)
    assert {t.name for t in derived.saved_tensors} == set(decisions) - fixed
    hw = toy_hardware(d2h_bytes_per_s=rng.choice([50.0, 1e4]), h2d_bytes_per_s=rng.choice([50.0, 1e4]))
    on_graph = build_schedule(graph, kept, planner="t", budget_bytes=None, hardware=hw)
    on_derived = build_schedule(derived, {n: d for n, d in decisions.items() if n not in fixed}, planner="t",
                                budget_bytes=None, hardware=hw)
    assert on_graph.steps == on_derived.steps
    a, b = simulate(graph, on_graph, hw, None), simulate(derived, on_derived, hw, None)
    assert a.peak_activation_bytes == b.peak_activation_bytes
    # The device bytes after every instant (frees at one instant may come in another order).
    assert dict(zip(a.memory_times_s, a.memory_bytes, strict=True)) == dict(
        zip(b.memory_times_s, b.memory_bytes, strict=True))
    assert a.step_s == pytest.approx(b.step_s)


def test_a_recompute_reads_a_tensor_held_into_the_backward_pass_instead_of_regenerating_it() -> None:
    """x is fixed: the recompute of y (which reads x) reads x's run copy, as it would a kept x."""
    g = make_graph(
        [fwd("f1", [], ["x"], 0.1), fwd("f2", ["x"], ["y"], 0.1), fwd("f3", ["y"], ["z"], 0.1),
         bwd("b3", ["z", "y"], ["gz"], 0.1), bwd("b2", ["gz", "x"], ["gx"], 0.1)],
        {"x": 100, "y": 100, "z": 100, "gz": 10, "gx": 10},
    )
    assert g.tensors["gz"].saved
    derived = graph_with_fixed_keep(g, {"x"})
    assert not derived.tensors["x"].saved and derived.tensors["x"].held_until == "b2"
    assert "x" not in derived.op_by_name["b2"].inputs
    decisions = {"y": Decision.RECOMPUTE, "z": Decision.KEEP, "gz": Decision.KEEP}
    plan = build_schedule(derived, decisions, planner="t", budget_bytes=None, hardware=toy_hardware())
    assert [(s.op, str(s.kind)) for s in plan.steps if s.kind == StepKind.RECOMPUTE] == [("f2", "recompute")]


def test_every_planner_plans_with_fixed_tensors_kept_within_the_budget_or_says_why() -> None:
    """milp is left out as in tests/test_planners.py (its time-limited solves take most of a minute here);
    tests/test_runtime_export.py runs it on a captured graph."""
    fixed = set(_forward_saved(GRAPH)[::3])
    met = 0
    for name in (p for p in available_planners() if p != "milp"):
        for fraction in (0.6, 0.8, None):
            budget = None if fraction is None else int(PEAK * fraction)
            try:
                plan = plan_with_fixed_keep(get_planner(name), GRAPH, HW, budget, fixed)
            except InfeasibleBudgetError as exc:
                assert "fixed to keep" in str(exc) and name in str(exc)
                continue
            assert all(plan.decisions[t] == Decision.KEEP for t in fixed), name
            assert plan.graph_fingerprint == GRAPH.fingerprint
            result = simulate(GRAPH, plan, HW, budget)
            assert result.feasible, name
            if budget is not None:
                assert estimate_plan(GRAPH, plan, HW).peak_bytes <= budget
                met += 1
            break
    assert met > 0


def test_tied_tensors_decide_alike_and_the_budget_holds() -> None:
    """Each tied pair takes its strongest decision (keep > swap > recompute); the plan still fits."""
    saved = _forward_saved(GRAPH)
    tied = [tuple(saved[i:i + 2]) for i in range(0, len(saved) - 1, 4)]
    budget = int(PEAK * 0.8)
    plan = plan_with_fixed_keep(get_planner("slackswap"), GRAPH, HW, budget, (), tied)
    for group in tied:
        assert len({plan.decisions[t] for t in group}) == 1
    assert estimate_plan(GRAPH, plan, HW).peak_bytes <= budget
    assert any(plan.decisions[t] != Decision.KEEP for t in plan.decisions)


def test_no_budget_a_fixed_keep_plan_is_the_planners_plan_with_them_kept() -> None:
    fixed = set(_forward_saved(GRAPH)[:4])
    plan = plan_with_fixed_keep(get_planner("keep_all"), GRAPH, HW, None, fixed)
    assert plan.steps == build_schedule(GRAPH, {t.name: Decision.KEEP for t in GRAPH.saved_tensors}, planner="x",
                                        budget_bytes=None, hardware=HW).steps
    assert simulate(GRAPH, plan, HW, None).peak_activation_bytes == simulate_ideal(GRAPH, HW).peak_activation_bytes


def test_a_fixed_tensor_must_be_a_saved_forward_tensor() -> None:
    gradient = next(t.name for t in GRAPH.saved_tensors if t.name not in _forward_saved(GRAPH)) \
        if len(_forward_saved(GRAPH)) < len(GRAPH.saved_tensors) else None
    for bad in ["no-such-tensor", *([gradient] if gradient else [])]:
        with pytest.raises(ConfigError, match="fixed_keep"):
            plan_with_fixed_keep(get_planner("keep_all"), GRAPH, HW, None, {bad})


class _Decides:
    """A planner that makes the given decisions, whatever the budget (a stand-in for a planner's choice)."""

    name = "decides"

    def __init__(self, decisions: dict[str, Decision]) -> None:
        self.decisions = decisions

    def plan(self, graph, hardware, budget_bytes):
        decisions = {t.name: self.decisions.get(t.name, Decision.KEEP) for t in graph.saved_tensors}
        return build_schedule(graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware)


def _layer_norm_graph():
    """LayerNorm's shape: `norm` makes `y` (not saved: a checkpoint candidate) beside its saved statistics
    `stats`; `lin` reads `y` and saves `z`. `y` and `stats` are one op's outputs, cached together."""
    specs = [fwd("embed", [], ["x"], 1e-3), fwd("norm", ["x"], ["y", "stats"], 1e-3), fwd("lin", ["y"], ["z"], 1e-3),
             fwd("loss", ["z"], ["l"], 1e-3), bwd("dloss", ["l"], ["dz"], 1e-3),
             bwd("dlin", ["dz", "z"], ["dy"], 1e-3), bwd("dnorm", ["dy", "stats"], ["dx"], 1e-3)]
    sizes = {"x": 64, "y": 64, "stats": 8, "z": 64, "l": 4, "dz": 64, "dy": 64, "dx": 64}
    return make_graph(specs, sizes)


def test_a_swap_whose_op_also_makes_a_candidate_no_recompute_reads_is_recomputed_with_the_reason() -> None:
    """Selective checkpointing offloads an op's outputs whole, so a swapped `stats` swaps `y` too; with `z`
    kept no recompute reads `y` back, a swap `build_schedule` refuses (the export's refusals of
    LayerNorm, topk and sort before this rule). The op is recomputed instead, and the notes say so."""
    graph = _layer_norm_graph()
    assert "y" in graph.candidate_names and graph.tensors["stats"].saved
    planner = _Decides({"stats": Decision.SWAP, "z": Decision.KEEP})
    with pytest.raises(ConfigError, match="no step reads it after the forward pass"):
        build_schedule(graph, {**{t.name: Decision.KEEP for t in graph.saved_tensors}, "stats": Decision.SWAP,
                               "y": Decision.SWAP}, planner="x",
                       budget_bytes=None, hardware=HW)
    plan = plan_with_fixed_keep(planner, graph, HW, None, (), cached_together=[("y", "stats")])
    assert plan.decisions["stats"] == Decision.RECOMPUTE and "y" not in plan.decisions
    assert not plan.offloads
    assert plan.notes["swaps_recomputed"] == 1 and plan.notes["swaps_recomputed_bytes"] == 8
    assert plan.notes["swaps_recomputed_reason"] == UNREAD_SWAP


def test_a_swap_whose_candidate_a_recompute_reads_stays_a_swap() -> None:
    """With `z` recomputed, the recompute of `lin` reads `y`: the op's swap has its reader and stays."""
    graph = _layer_norm_graph()
    planner = _Decides({"stats": Decision.SWAP, "z": Decision.RECOMPUTE})
    plan = plan_with_fixed_keep(planner, graph, HW, None, (), cached_together=[("y", "stats")])
    assert plan.decisions["stats"] == Decision.SWAP and plan.decisions["y"] == Decision.SWAP
    assert {t.tensor for t in plan.prefetches} == {"y", "stats"}
    assert "swaps_recomputed" not in plan.notes
