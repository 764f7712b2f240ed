"""The planners' speed-ups leave every plan as the definitions they shortcut would make it.

Each shortcut is checked against the definition it replaces, on random graphs: the plan with the
shortcut must equal the plan without it, and every bound a shortcut relies on must hold.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from slackswap.errors import InfeasibleBudgetError, SlackSwapError
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision
from slackswap.planners.base import gib
from slackswap.planners.registry import get_planner
from slackswap.planners.strategies import recompute_knapsack, swap_only
from slackswap.planners.support import analysis, greedy, swap_recompute
from slackswap.planners.support.analysis import analyse
from slackswap.planners.support.budget_check import scheduled_peak
from slackswap.planners.support.candidates import keep_chain_candidates
from slackswap.planners.support.greedy import keep_all_if_it_fits, recompute_candidates
from slackswap.profile import build_graph
from slackswap.schedule import build_schedule, estimate_plan, keep_all_plan
from slackswap.schedule.free_rule import free_time_s
from slackswap.schedule.replay import peak_bytes
from slackswap.testing import random_decisions, random_graph, toy_hardware

ROOT = Path(__file__).resolve().parents[1]


def _yaml(group: str, name: str) -> dict:
    return yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())


def _plan_or_reason(planner, graph, hw, budget):
    """The plan, or the error it raised (on `random_graph`s, whose gradients have backward readers and
    so count as saved, most planners but slackswap pick a gradient to recompute and the build rejects
    it: a known limitation; the presets and traced graphs save no gradient)."""
    try:
        plan = planner.plan(graph, hw, budget)
    except InfeasibleBudgetError as exc:
        return ("infeasible", exc.reason)
    except SlackSwapError as exc:
        return ("error", str(exc))
    return (plan.decisions, plan.steps, plan.offloads, plan.prefetches, plan.notes)


def _cases(seeds: range) -> list[tuple]:
    """Random graphs, and 2-layer analytic presets with slow and fast links, at several budgets."""
    graphs = []
    for seed in seeds:
        rng = random.Random(seed)
        graph = random_graph(rng, max_layers=8, real_program=seed % 2 == 1)
        graphs.append((graph, toy_hardware(rng.choice([20.0, 200.0, 2000.0]), rng.choice([20.0, 200.0, 2000.0]),
                                           rng.choice([0.0, 0.05]))))
    a100 = Hardware.from_dict(_yaml("hardware", "a100_80gb_pcie4"))
    slow = replace(a100, link=replace(a100.link, d2h_effective_bytes_per_s=a100.link.d2h_effective_bytes_per_s / 8,
                                      h2d_effective_bytes_per_s=a100.link.h2d_effective_bytes_per_s / 8))
    for model in ("tiny", "bert_large", "gpt2_xl", "llama2_70b"):
        graph = build_graph(ModelConfig.from_dict({**_yaml("model", model), "num_layers": 2}), a100)
        graphs += [(graph, a100), (graph, slow)]
    cases = []
    for graph, hw in graphs:
        peak = estimate_plan(graph, keep_all_plan(graph), hw).peak_bytes
        cases += [(graph, hw, int(fraction * peak)) for fraction in (0.3, 0.5, 0.7, 0.9)]
    return cases


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False), st.booleans())
def test_step_lower_bound_holds_for_any_schedule(rng, real):
    """`step_lower_bounds_s`: keep-all step + one re-run of each recomputed tensor's producer is at
    most the replayed step of any schedule recomputing those tensors (with anything else swapped or
    recomputed too)."""
    graph = random_graph(rng, max_layers=6, real_program=real)
    hw = toy_hardware(rng.choice([50.0, 500.0]), rng.choice([50.0, 500.0]), rng.choice([0.0, 0.1]))
    profile = analyse(graph, hw)
    decisions = random_decisions(graph, rng)
    recomputed = [t for t, d in decisions.items() if d == Decision.RECOMPUTE]
    rng.shuffle(recomputed)
    bounds = swap_recompute.step_lower_bounds_s(graph, profile, recomputed)
    assert bounds[0] == profile.ideal_step_s
    assert all(a <= b for a, b in zip(bounds, bounds[1:], strict=False))
    step_s = estimate_plan(graph, build_schedule(graph, decisions, planner="t", budget_bytes=None, hardware=hw),
                           hw).step_s
    assert bounds[-1] <= step_s
    assert bounds[0] <= estimate_plan(graph, keep_all_plan(graph), hw).step_s


def test_dropping_swapped_sets_that_cannot_win_keeps_the_plan(monkeypatch):
    """`SwapThenRecompute` stops a swapped set's prefix search once it cannot beat the best plan so far
    (only slackswap tries several sets); the plan (and the error, when none fits) must be the one of
    the full search."""
    planner = get_planner("slackswap")
    cases = _cases(range(30))
    real_cannot_beat = swap_recompute._cannot_beat
    gave_up = []

    def counting(*args):
        hopeless = real_cannot_beat(*args)

        def asked(k):
            gave_up.append(hopeless(k))
            return gave_up[-1]

        return asked

    monkeypatch.setattr(swap_recompute, "_cannot_beat", counting)
    pruned = [_plan_or_reason(planner, *case) for case in cases]
    monkeypatch.setattr(swap_recompute, "_cannot_beat", lambda *args: lambda k: False)
    full = [_plan_or_reason(planner, *case) for case in cases]
    assert pruned == full
    assert sum(gave_up) >= 5  # the shortcut did fire
    assert sum(p[0] not in ("infeasible", "error") for p in full) > len(cases) // 4


def _bisect(lo, hi, holds, guess):
    """The search `first_true` replaced: bisection of (lo, hi], the guess unused."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


@settings(max_examples=200, deadline=None)
@given(st.integers(-1, 60), st.integers(0, 60), st.integers(-5, 70))
def test_first_true_finds_the_boundary_from_any_guess(lo, span, guess):
    hi = lo + 1 + span
    for answer in range(lo + 1, hi + 1):
        calls = []

        def holds(k, answer=answer, calls=calls):
            assert lo < k <= hi
            calls.append(k)
            return k >= answer

        assert greedy.first_true(lo, hi, holds, guess) == answer == _bisect(lo, hi, holds, guess)
        distance = abs(answer - min(max(guess, lo + 1), hi))
        calls.clear()
        greedy.first_true(lo, hi, holds, guess)
        assert len(calls) <= 2 * math.log2(distance + 1) + 2


@pytest.mark.parametrize("name", ["swap_only", "selective_recompute"])
def test_layer_count_search_from_the_guess_gives_the_bisection_plan(name, monkeypatch):
    """swap_only and selective_recompute search their layer count from the byte-count guess; on
    random graphs and small presets the plan is the one bisection found."""
    options = {"memory_waits": False} if name == "swap_only" else {}
    cases = _cases(range(30))
    planners = [get_planner(name), get_planner(name, **options)]
    guessed = [_plan_or_reason(p, *case) for case in cases for p in planners]
    monkeypatch.setattr(greedy, "first_true", _bisect)
    monkeypatch.setattr(swap_only, "first_true", _bisect)
    bisected = [_plan_or_reason(p, *case) for case in cases for p in planners]
    assert guessed == bisected
    counts = [p[4].get("offloaded_layers", p[4].get("recomputed_layers")) for p in guessed if p[0] != "infeasible"]
    assert len([c for c in counts if c]) >= 10  # plans the search had to find a layer count for


def _knapsack_rebuilding_every_round(graph, hw, budget_bytes, max_rounds=30):
    """`RecomputeKnapsack.plan` before it remembered the peak of a set chosen again (with its fallback,
    every candidate recomputed, when no round fits)."""
    profile = analyse(graph, hw)
    unconstrained = keep_all_if_it_fits(graph, hw, profile, budget_bytes, "recompute_knapsack")
    if unconstrained is not None:
        return unconstrained
    candidates = recompute_candidates(graph, profile, set())
    sizes = [profile.tensors[t].size_bytes for t in candidates]
    costs = [profile.tensors[t].regen_s for t in candidates]
    need = profile.keep_all_peak_bytes - budget_bytes
    for round_ in range(max_rounds):
        chosen = recompute_knapsack.solve_knapsack(sizes, costs, need)
        if chosen is None:
            return _recompute_every_candidate(graph, hw, budget_bytes, profile, candidates, "no set")
        decisions = {t: Decision.KEEP for t in profile.tensors}
        decisions.update({candidates[i]: Decision.RECOMPUTE for i in chosen})
        plan, peak = scheduled_peak(
            graph, decisions, planner="recompute_knapsack", budget_bytes=budget_bytes, hardware=hw,
            notes={"knapsack_need_bytes": need, "knapsack_rounds": round_ + 1,
                   "knapsack_recompute_s": sum(costs[i] for i in chosen)},
        )
        if peak <= budget_bytes:
            return keep_chain_candidates(graph, hw, budget_bytes, plan)  # the planner's last step
        need += peak - budget_bytes
    reason = f"after {max_rounds} rounds the plan still peaks at {peak}"
    return _recompute_every_candidate(graph, hw, budget_bytes, profile, candidates, reason)


def _recompute_every_candidate(graph, hw, budget_bytes, profile, candidates, reason):
    decisions = {t: Decision.KEEP for t in profile.tensors}
    decisions.update(dict.fromkeys(candidates, Decision.RECOMPUTE))
    plan, peak = scheduled_peak(
        graph, decisions, planner="recompute_knapsack", budget_bytes=budget_bytes, hardware=hw,
        notes={"knapsack_fallback": "recompute every candidate"},
    )
    if peak <= budget_bytes:
        return plan
    raise InfeasibleBudgetError(reason)


@pytest.mark.slow
@pytest.mark.parametrize("max_rounds", [2, 30])
def test_knapsack_rounds_that_choose_a_set_again_keep_the_outcome(monkeypatch, max_rounds):
    """recompute_knapsack does not rebuild the schedule of a set it chose before; the plan, or the
    peak it reports when no round fits, is that of rebuilding every round. The solver is made to
    repeat itself (it returns the previous set while that still covers the need) so the shortcut is
    exercised."""
    real_solve = recompute_knapsack.solve_knapsack
    last: list[list[int]] = []

    def sticky(sizes, costs, need):
        if last and sum(sizes[i] for i in last[-1]) >= need:
            return list(last[-1])
        last.append(real_solve(sizes, costs, need))
        return last[-1]

    monkeypatch.setattr(recompute_knapsack, "solve_knapsack", sticky)
    planner = get_planner("recompute_knapsack", max_rounds=max_rounds)
    outcomes = []
    for graph, hw, budget in _cases(range(20)):
        last.clear()
        new = _plan_or_reason(planner, graph, hw, budget)
        last.clear()
        try:
            old = _knapsack_rebuilding_every_round(graph, hw, budget, max_rounds)
            old = (old.decisions, old.steps, old.offloads, old.prefetches, old.notes)
        except InfeasibleBudgetError as exc:
            old = ("infeasible", exc.reason)
        except SlackSwapError as exc:
            old = ("error", str(exc))
        if old[0] == "infeasible":
            assert new[0] == "infeasible"
            if "rounds" in old[1]:
                assert f"still peaks at {gib(int(old[1].split()[-1]))}" in new[1]
        else:
            assert new == old
        outcomes.append(new[0])
    assert outcomes.count("infeasible") > 0
    assert len(outcomes) - outcomes.count("infeasible") - outcomes.count("error") > 10


def _regen_walk_by_graph_lookups(graph, tensor, missing):
    """`analysis.regen_walk` before its lookup tables."""
    ops, frontier, stack, seen = set(), set(), [tensor], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        producer = graph.op_by_name[graph.tensors[name].producer]
        ops.add(producer.name)
        for t in producer.inputs:
            if t == tensor or t in missing or not graph.tensors[t].saved:
                stack.append(t)
            else:
                frontier.add(t)
    return ops, frontier


def test_regen_walk_builds_the_same_sets_in_the_same_order():
    """DTR sums a chain's op times in the set's iteration order; the walk must build the very same
    sets (same insertions in the same order), not just equal ones, so every float stays the same."""
    for seed in range(40):
        rng = random.Random(seed)
        graph = random_graph(rng, max_layers=10, real_program=seed % 2 == 1)
        saved = [t.name for t in graph.saved_tensors]
        for t in saved:
            missing = {m for m in saved if rng.random() < 0.5}
            ops, frontier = analysis.regen_walk(graph, t, missing)
            ref_ops, ref_frontier = _regen_walk_by_graph_lookups(graph, t, missing)
            assert (list(ops), list(frontier)) == (list(ref_ops), list(ref_frontier))


_instants = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.5]))


@given(st.one_of(st.floats(allow_nan=True), st.sampled_from([0.0, -0.0, 1.5])), _instants, _instants, _instants)
def test_free_time_is_the_max_of_the_given_instants(produced, last_read, offload, aliases):
    """`memory.free_time_s`, written out for speed, returns the very object `max` returns."""
    expected = max([produced, *(t for t in (last_read, offload, aliases) if t is not None)])
    got = free_time_s(produced, last_read, offload, aliases)
    assert got is expected or (got == expected and math.copysign(1, got) == math.copysign(1, expected))


def _peak_by_merging(alloc_s, free_s, size_bytes):
    """The replay's peak before `replay.peak_bytes`: allocations and frees as sorted tuples, merged."""
    allocs = sorted((a, s) for a, s in zip(alloc_s, size_bytes, strict=True) if s)
    frees = sorted((f, s) for f, s in zip(free_s, size_bytes, strict=True) if s)
    current = peak = 0
    peak_time = 0.0
    k = 0
    for time_s, size in allocs:
        while k < len(frees) and frees[k][0] <= time_s:
            current -= frees[k][1]
            k += 1
        current += size
        if current > peak:
            peak, peak_time = current, time_s
    return peak, peak_time


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3), st.sampled_from([0, 0, 1, 7, 2**40])), max_size=40))
def test_peak_bytes_is_the_merge_of_sorted_events(copies):
    """Copies alive from a to a + d (ties and zero-length lives on purpose, zero-byte copies too)."""
    alloc_s = [a / 4 for a, _, _ in copies]
    free_s = [(a + d) / 4 for a, d, _ in copies]
    sizes = [s for _, _, s in copies]
    assert peak_bytes(alloc_s, free_s, sizes) == _peak_by_merging(alloc_s, free_s, sizes)
