"""slackswap drops the swaps its budget does not need (`planners/support/unneeded_swaps.py`): the
smallest latency-bound swaps are returned to keep while the peak fits and the step is no longer;
checked against the same planner with `only_needed_swaps: false`, in the simulator (not the planner's
replay)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision
from slackswap.planners.registry import get_planner
from slackswap.planners.support import unneeded_swaps
from slackswap.planners.support.unneeded_swaps import (
    drop_unneeded_swaps,
    latency_bound_bytes,
    latency_bound_swaps_smallest_first,
    predicted_fitting_count,
)
from slackswap.profile import build_graph
from slackswap.schedule.build import build_schedule, keep_all_plan
from slackswap.schedule.replay import estimate_plan, peak_bytes
from slackswap.simulate import simulate
from slackswap.testing import random_graph, toy_hardware

CONF = Path(__file__).resolve().parents[1] / "conf"
HW = Hardware.from_dict(yaml.safe_load((CONF / "hardware" / "a100_80gb_pcie4.yaml").read_text()))


def _graph(model: str, layers: int | None = None):
    data = yaml.safe_load((CONF / "model" / f"{model}.yaml").read_text())
    if layers is not None:
        data["num_layers"] = layers
    graph = build_graph(ModelConfig.from_dict(data), HW)
    return graph, simulate(graph, keep_all_plan(graph), HW, None).peak_activation_bytes


def _both(graph, hardware, budget):
    """(slackswap's plan, the plan with every hidden swap left in)"""
    return (get_planner("slackswap").plan(graph, hardware, budget),
            get_planner("slackswap", only_needed_swaps=False).plan(graph, hardware, budget))


def test_the_smallest_swaps_go_back_to_keep_and_the_plan_still_fits_and_steps_no_slower():
    # The tiny preset at 90 % of its peak: every tensor's copy is latency-bound on the A100's link,
    # and the swap-first plan's peak sits well below the budget.
    graph, peak = _graph("tiny")
    budget = int(0.9 * peak)
    plan, every_hidden = _both(graph, HW, budget)
    swapped, before = set(plan.tensors_with(Decision.SWAP)), set(every_hidden.tensors_with(Decision.SWAP))
    returned = before - swapped
    assert swapped < before and len(returned) == plan.notes["dropped_swaps"] > 0
    assert {t: d for t, d in plan.decisions.items() if t not in returned} == {
        t: d for t, d in every_hidden.decisions.items() if t not in returned}
    assert all(plan.decisions[t] == Decision.KEEP for t in returned)
    # Smallest first: nothing returned is larger than anything still swapped.
    assert max(graph.tensors[t].size_bytes for t in returned) <= min(graph.tensors[t].size_bytes for t in swapped)
    assert len(plan.offloads) < len(every_hidden.offloads)
    result, result_before = simulate(graph, plan, HW, budget), simulate(graph, every_hidden, HW, budget)
    assert result.feasible and result.peak_activation_bytes <= budget
    assert result.step_s <= result_before.step_s
    assert result.peak_activation_bytes > result_before.peak_activation_bytes  # the headroom was used


def test_a_swap_whose_copy_is_bandwidth_bound_stays_however_much_headroom_there_is():
    # Llama-2-70B at 8 layers, half its peak: the swap-first plan peaks far below the budget, but
    # every swapped tensor is hundreds of MB, its copy's time almost all bytes: the simulator prices
    # those, so keeping them instead would only spend the headroom the caching allocator's rounding
    # and fragmentation need (docs/planners.md).
    graph, peak = _graph("llama2_70b", 8)
    plan, every_hidden = _both(graph, HW, int(0.5 * peak))
    assert estimate_plan(graph, plan, HW).peak_bytes < 0.9 * int(0.5 * peak)
    assert all(graph.tensors[t].size_bytes > latency_bound_bytes(HW) for t in plan.tensors_with(Decision.SWAP))
    assert "dropped_swaps" not in plan.notes and dict(plan.decisions) == dict(every_hidden.decisions)


def test_a_copy_is_latency_bound_while_its_bytes_take_no_longer_than_its_fixed_part():
    # The A100's PCIe 4.0 preset: 10 us of latency at 25 GB/s per direction, one engine each.
    assert latency_bound_bytes(HW) == pytest.approx(1e-5 * 25e9)
    two_engines = toy_hardware(d2h_bytes_per_s=100.0, h2d_bytes_per_s=400.0, latency_s=0.5, h2d_engines=2)
    assert latency_bound_bytes(two_engines) == pytest.approx(min(0.5 * 100.0, 0.5 * 400.0 / 2))


def test_the_next_smallest_swap_is_beyond_the_prediction_and_the_prediction_over_counts():
    graph, peak = _graph("tiny")
    budget = int(0.9 * peak)
    every_hidden = get_planner("slackswap", only_needed_swaps=False).plan(graph, HW, budget)
    order = latency_bound_swaps_smallest_first(graph, HW, every_hidden)
    replay = estimate_plan(graph, every_hidden, HW)
    k = predicted_fitting_count(graph, every_hidden, replay, order, budget)
    assert 0 < k < len(order)
    for kept, fits in ((k, True), (k + 1, False)):
        decisions = dict(every_hidden.decisions) | dict.fromkeys(order[:kept], Decision.KEEP)
        rebuilt = estimate_plan(graph, build_schedule(graph, decisions, planner="t", budget_bytes=budget,
                                                      hardware=HW), HW)
        # The prediction of `kept`: the plan's profile plus each kept tensor's off-device window.
        windows = [(replay.offload_end_s[i], t.tensor) for i, t in enumerate(every_hidden.offloads)]
        start = {name: s for s, name in windows}
        end = {t.tensor: replay.prefetch_start_s[i] for i, t in enumerate(every_hidden.prefetches)}
        predicted = peak_bytes(
            (*replay.copy_alloc_s, *(start[t] for t in order[:kept])),
            (*replay.copy_free_s, *(max(end.get(t, start[t]), start[t]) for t in order[:kept])),
            (*replay.copy_size_bytes, *(graph.tensors[t].size_bytes for t in order[:kept])),
        )[0]
        assert (predicted <= budget) == fits
        assert rebuilt.peak_bytes <= predicted
    assert replay.peak_bytes == peak_bytes(replay.copy_alloc_s, replay.copy_free_s, replay.copy_size_bytes)[0]


def test_a_binding_budget_leaves_the_plan_as_it_was():
    graph, peak = _graph("bert_large")
    plan, every_hidden = _both(graph, HW, int(0.5 * peak))
    assert "dropped_swaps" not in plan.notes
    assert dict(plan.decisions) == dict(every_hidden.decisions) and plan.steps == every_hidden.steps


def test_a_prediction_that_misses_is_shortened_until_the_replay_fits(monkeypatch):
    graph, peak = _graph("tiny")
    budget = int(0.9 * peak)
    every_hidden = get_planner("slackswap", only_needed_swaps=False).plan(graph, HW, budget)
    n = len(latency_bound_swaps_smallest_first(graph, HW, every_hidden))
    honest = drop_unneeded_swaps(graph, HW, budget, every_hidden)
    monkeypatch.setattr(unneeded_swaps, "predicted_fitting_count", lambda *_: n)  # keep every swap: too much
    shortened = drop_unneeded_swaps(graph, HW, budget, every_hidden)
    assert 0 < shortened.notes["dropped_swaps"] < n
    assert estimate_plan(graph, shortened, HW).peak_bytes <= budget
    # Galloping down from n finds a prefix at least as long as the prediction's (the peak is monotone here).
    assert shortened.notes["dropped_swaps"] >= honest.notes["dropped_swaps"]


def test_the_option_must_be_true_or_false():
    with pytest.raises(ConfigError, match="planner.options.only_needed_swaps"):
        get_planner("slackswap", only_needed_swaps="yes")


def test_the_seed_rule_is_not_changed():
    graph, peak = _graph("tiny")
    plan = get_planner("slackswap_seed").plan(graph, HW, int(0.9 * peak))
    assert plan.offloads
    assert "dropped_swaps" not in plan.notes


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.sampled_from([0.8, 0.9, 0.95]),
       st.sampled_from([50.0, 400.0, 1000.0]), st.sampled_from([0.125, 0.5, 2.0]))
def test_on_random_graphs_dropping_swaps_never_breaks_the_budget_or_slows_the_step(
    rng: random.Random, fraction: float, link_bytes_per_s: float, latency_s: float
):
    # Budgets near the keep-all peak: slackswap (no layer boundary recomputed) finds most random
    # graphs infeasible at lower ones. Latencies that make copies of 6-2000 bytes latency-bound
    # (sizes are 0-1000 bytes): about a third of the feasible plans drop swaps.
    graph = random_graph(rng, max_layers=6, real_program=True, in_place=True)
    hw = toy_hardware(d2h_bytes_per_s=link_bytes_per_s, h2d_bytes_per_s=link_bytes_per_s, latency_s=latency_s)
    budget = max(1, int(fraction * simulate(graph, keep_all_plan(graph), hw, None).peak_activation_bytes))
    try:
        plan, every_hidden = _both(graph, hw, budget)
    except InfeasibleBudgetError:
        return
    swapped, before = set(plan.tensors_with(Decision.SWAP)), set(every_hidden.tensors_with(Decision.SWAP))
    assert swapped <= before and len(before - swapped) == plan.notes.get("dropped_swaps", 0)
    result = simulate(graph, plan, hw, budget)
    assert result.feasible and result.peak_activation_bytes <= budget
    assert result.step_s <= simulate(graph, every_hidden, hw, budget).step_s
