"""Every planner's defining behaviour, and its plans judged by the simulator."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import Phase
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision, StepKind
from slackswap.planners.registry import available_planners, get_planner
from slackswap.planners.strategies.recompute_knapsack import solve_knapsack
from slackswap.planners.strategies.selective_recompute import attention_core_tensors
from slackswap.planners.support.analysis import analyse, boundary_tensors
from slackswap.planners.support.min_budget import min_feasible_fraction
from slackswap.profile import build_graph
from slackswap.schedule.build import keep_all_plan
from slackswap.simulate import simulate, validate_plan

CONF = Path(__file__).resolve().parents[1] / "conf"
#: Every registered planner but milp (its time-limited solves have their own tests in test_milp.py).
PLANNERS = tuple(p for p in available_planners() if p != "milp")


def _model(name: str, **over) -> ModelConfig:
    return ModelConfig.from_dict({**yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()), **over})


HW = Hardware.from_dict(yaml.safe_load((CONF / "hardware" / "a100_80gb_pcie4.yaml").read_text()))
# A small GPT-2-shaped model with enough layers and sequence for swap and recompute to both matter.
GRAPH = build_graph(_model("tiny", num_layers=4, seq_len=256, micro_batch_size=4, hidden_size=256,
                           ffn_hidden_size=1024), HW)
PEAK = simulate(GRAPH, keep_all_plan(GRAPH), HW, None).peak_activation_bytes
IDEAL = simulate(GRAPH, keep_all_plan(GRAPH), HW, None).step_s


def _plan_or_none(name, fraction, graph=GRAPH, peak=PEAK):
    budget = int(fraction * peak)
    try:
        plan = get_planner(name).plan(graph, HW, budget)
    except InfeasibleBudgetError as exc:
        assert exc.reason  # a specific, non-empty reason
        return None, budget
    return plan, budget


def _largest_op_need_bytes(graph) -> int:
    """Bytes one op needs resident at once (its distinct inputs and its outputs): no plan fits below."""
    return max(sum(graph.owned_bytes(t) for t in {*op.inputs, *op.outputs}) for op in graph.ops)


@functools.cache
def _bisected_minimum(name: str) -> float | None:
    return min_feasible_fraction(get_planner(name), GRAPH, HW, PEAK, tol=0.01).fraction


@pytest.mark.parametrize(("name", "fraction"), list(itertools.product(PLANNERS, (0.3, 0.5, 0.7))))
def test_plan_is_valid_and_fits_the_budget_in_the_simulator(name, fraction):
    """Never vacuous: a returned plan must run within the budget in the simulator; a raise must come
    at a budget shown infeasible for the planner (below its bisected minimum) or for any plan (below
    the largest single op's need)."""
    plan, budget = _plan_or_none(name, fraction)
    if plan is None:
        minimum = _bisected_minimum(name)
        below_minimum = minimum is None or fraction < minimum
        assert below_minimum or budget < _largest_op_need_bytes(GRAPH), (
            f"{name} raised at {fraction:.0%} although it plans at {minimum:.1%} of the keep-all peak"
        )
        if minimum is not None:  # and the minimum it reports is real: that plan fits in the simulator
            plan_at_min, budget_at_min = _plan_or_none(name, minimum)
            assert plan_at_min is not None
            assert simulate(GRAPH, plan_at_min, HW, budget_at_min).feasible
        return
    validate_plan(GRAPH, plan)
    result = simulate(GRAPH, plan, HW, budget)
    assert result.feasible, result.infeasible_reason
    assert result.peak_activation_bytes <= budget
    if name != "swap_only":  # vDNN as published waits for its offloads (tests/test_baselines.py)
        assert result.stall_memory_s == 0.0  # planners hand over plans that never wait for memory


def test_registry_lists_every_planner_and_names_known_ones_on_error():
    assert set(PLANNERS) <= set(available_planners())
    with pytest.raises(ConfigError, match="unknown planner.*slackswap"):
        get_planner("nope")
    with pytest.raises(ConfigError, match="not accepted"):
        get_planner("slackswap", bogus=1)


@pytest.mark.parametrize("name", PLANNERS)
def test_conf_planner_yaml_builds_its_planner(name):
    data = yaml.safe_load((CONF / "planner" / f"{name}.yaml").read_text())
    assert data["name"] == name
    assert get_planner(data["name"], **data["options"]).name == name


def test_keep_all_is_infeasible_below_the_peak_and_ideal_at_it():
    with pytest.raises(InfeasibleBudgetError, match="keep_all"):
        get_planner("keep_all").plan(GRAPH, HW, PEAK - 1)
    assert simulate(GRAPH, get_planner("keep_all").plan(GRAPH, HW, PEAK), HW, PEAK).step_s == IDEAL


def test_swap_only_never_recomputes_and_prefetches_one_layer_ahead():
    plan, _ = _plan_or_none("swap_only", 0.9)
    assert plan is not None and plan.tensors_with(Decision.SWAP)
    assert not plan.tensors_with(Decision.RECOMPUTE)
    assert all(s.kind == StepKind.RUN for s in plan.steps)


@pytest.mark.parametrize("name", ["recompute_knapsack", "full_recompute", "selective_recompute"])
def test_recompute_only_planners_never_swap(name):
    plan, _ = _plan_or_none(name, 0.7)
    assert plan is not None
    assert not plan.offloads and not plan.prefetches and not plan.tensors_with(Decision.SWAP)


def test_full_recompute_keeps_only_layer_boundaries_inside_the_stack():
    plan = get_planner("full_recompute").plan(GRAPH, HW, None)
    boundary = boundary_tensors(GRAPH)
    for t, d in plan.decisions.items():
        in_stack = GRAPH.op_by_name[GRAPH.tensors[t].producer].layer >= 0
        assert d == (Decision.RECOMPUTE if in_stack and t not in boundary else Decision.KEEP), t


def test_selective_recompute_drops_only_the_attention_core():
    plan, _ = _plan_or_none("selective_recompute", 0.7)
    core = {t for ts in attention_core_tensors(GRAPH).values() for t in ts}
    assert plan is not None and set(plan.tensors_with(Decision.RECOMPUTE)) <= core
    roles = {GRAPH.op_by_name[GRAPH.tensors[t].producer].role for t in plan.tensors_with(Decision.RECOMPUTE)}
    assert roles <= {"softmax", "softmax_dropout", "qk_bmm"}


def test_the_knapsack_is_re_solved_only_when_its_last_optimum_no_longer_covers_the_need(monkeypatch):
    """recompute_knapsack's rounds raise the need by the plan's excess; while the last optimal set
    still frees the raised need it is still optimal, so no solve is run for it (tiny at 70 %: six
    rounds, four solves), and every solve run asks for more than the last optimum frees."""
    import slackswap.planners.strategies.recompute_knapsack as knapsack

    solved: list[tuple[int, int]] = []  # (need, bytes the optimum frees)

    def counted(sizes, costs, need):
        chosen = solve_knapsack(sizes, costs, need)
        solved.append((need, sum(sizes[i] for i in chosen or ())))
        return chosen

    monkeypatch.setattr(knapsack, "solve_knapsack", counted)
    graph = build_graph(_model("tiny"), HW)
    from slackswap.schedule.replay import estimate_plan

    peak = estimate_plan(graph, keep_all_plan(graph, HW), HW).peak_bytes
    plan = get_planner("recompute_knapsack").plan(graph, HW, int(0.7 * peak))
    assert plan.notes["knapsack_rounds"] > len(solved) > 1
    assert all(need > freed for (_, freed), (need, _) in itertools.pairwise(solved)), solved


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.sampled_from([0.5, 1.0, 2.0, 3.5])), min_size=1, max_size=9),
       st.integers(0, 120))
def test_knapsack_is_optimal_against_brute_force(items, need):
    sizes = [s for s, _ in items]
    costs = [c for _, c in items]
    best = None
    for mask in range(1 << len(items)):
        chosen = [i for i in range(len(items)) if mask >> i & 1]
        if sum(sizes[i] for i in chosen) >= need:
            cost = sum(costs[i] for i in chosen)
            best = cost if best is None else min(best, cost)
    got = solve_knapsack(sizes, costs, need)
    if best is None:
        assert got is None
    else:
        assert got is not None and sum(sizes[i] for i in got) >= need
        assert sum(costs[i] for i in got) == pytest.approx(best)


def test_slackswap_swaps_hide_and_it_is_never_slower_than_the_seed_here():
    for fraction in (0.5, 0.7):
        plan, budget = _plan_or_none("slackswap", fraction)
        seed, _ = _plan_or_none("slackswap_seed", fraction)
        assert plan is not None and seed is not None
        result = simulate(GRAPH, plan, HW, budget)
        assert result.stall_prefetch_s == 0.0
        assert result.step_s <= simulate(GRAPH, seed, HW, budget).step_s * (1 + 1e-9)


def test_slackswap_offloads_finish_before_the_forward_pass_ends():
    plan, budget = _plan_or_none("slackswap", 0.5)
    result = simulate(GRAPH, plan, HW, budget)
    forward_end = analyse(GRAPH, HW).forward_end_s
    d2h_ends = [e.end_s for e in result.events if e.stream == "d2h"]
    assert d2h_ends and max(d2h_ends) <= forward_end + 1e-12


def test_slackswap_never_recomputes_a_tensor_that_can_never_leave_the_device():
    # A shallow model with a large vocabulary: the fp32 loss probabilities are produced by the last
    # forward op and read by the first backward op, so recomputing them re-runs the LM head at once
    # and frees nothing at any instant. The seed's rule and capuchin rank them cheap per byte.
    graph = build_graph(_model("tiny", num_layers=2, seq_len=256, micro_batch_size=4, hidden_size=256,
                               ffn_hidden_size=1024, vocab_size=2048), HW)
    info = analyse(graph, HW)
    stuck = [t for t, i in info.tensors.items() if i.off_device_window_s == 0]
    assert "loss.probs" in stuck
    assert sum(info.tensors[t].size_bytes for t in stuck) > 0.15 * info.keep_all_peak_bytes
    assert all(info.tensors[t].off_device_window_s > 0 for t in info.tensors if t not in stuck)
    budget = int(0.7 * info.keep_all_peak_bytes)
    plan = get_planner("slackswap").plan(graph, HW, budget)
    assert not set(stuck) & set(plan.tensors_with(Decision.RECOMPUTE))
    step = simulate(graph, plan, HW, budget).step_s
    for other in ("slackswap_seed", "capuchin"):
        rival = get_planner(other).plan(graph, HW, budget)
        assert "loss.probs" in rival.tensors_with(Decision.RECOMPUTE)  # the weakness this guards against
        assert step < simulate(graph, rival, HW, budget).step_s


def test_capuchin_ranks_swaps_by_free_time():
    plan, _ = _plan_or_none("capuchin", 0.5)
    info = analyse(GRAPH, HW).tensors
    swapped = plan.tensors_with(Decision.SWAP)
    assert swapped
    longest = max(info, key=lambda t: info[t].first_backward_use_s - info[t].ready_s)
    assert longest in swapped


def test_min_feasible_fraction_brackets_the_threshold():
    planner = get_planner("full_recompute")
    res = min_feasible_fraction(planner, GRAPH, HW, PEAK, tol=0.01)
    assert res.fraction is not None and res.infeasible_fraction is not None
    assert res.fraction - res.infeasible_fraction <= 0.01
    planner.plan(GRAPH, HW, int(res.fraction * PEAK))
    with pytest.raises(InfeasibleBudgetError):
        planner.plan(GRAPH, HW, int(res.infeasible_fraction * PEAK))


def test_bad_budget_is_rejected():
    with pytest.raises(ConfigError, match="budget_bytes"):
        get_planner("slackswap").plan(GRAPH, HW, -5)


def test_flash_attention_leaves_selective_recompute_only_the_fused_kernel_outputs():
    g = build_graph(_model("tiny", attention="flash"), HW)
    core = attention_core_tensors(g)
    roles = {g.op_by_name[g.tensors[t].producer].role for ts in core.values() for t in ts}
    assert roles <= {"flash_attn"}
    assert all(g.op_by_name[c].phase != Phase.FORWARD or g.op_by_name[c].role == "flash_attn"
               for ts in core.values() for t in ts for c in g.tensors[t].consumers)


def test_slackswap_prices_the_outputs_of_one_op_together():
    # drop makes out (200 B) and mask (100 B) in 0.3 s; gelu makes g (50 B) in 0.068 s. Alone, out
    # costs 1.5 ms/B and g 1.36 ms/B, so a per-tensor ranking takes g first; the pair costs 1 ms/B.
    from slackswap.planners.strategies.slackswap import order_by_group_marginal_cost
    from slackswap.planners.support.greedy import order_by_marginal_cost
    from slackswap.testing import bwd, fwd, make_graph, toy_hardware

    g = make_graph(
        [fwd("f0", [], ["x"], 0.1), fwd("drop", ["x"], ["out", "mask"], 0.3), fwd("gelu", ["out"], ["g"], 0.068),
         bwd("b2", ["g"], ["gg"], 0.1), bwd("b1", ["out", "mask", "x", "gg"], ["gx"], 0.1)],
        {"x": 10, "out": 200, "mask": 100, "g": 50, "gg": 0, "gx": 0},
    )
    analysis = analyse(g, toy_hardware())
    assert order_by_marginal_cost(g, analysis, ["out", "mask", "g"])[0] == "g"
    assert order_by_group_marginal_cost(g, analysis, ["out", "mask", "g"]) == ["out", "mask", "g"]


def test_slackswap_may_recompute_a_boundary_whose_chain_is_one_op_of_its_layer():
    from slackswap.planners.strategies.slackswap import in_layer_boundaries

    # Post-LN BERT: a layer hands ln2(add2) to the next; regenerating it re-runs ln2 alone.
    graph = build_graph(_model("bert_large", num_layers=4, seq_len=128, micro_batch_size=2), HW)
    analysis = analyse(graph, HW)
    allowed = in_layer_boundaries(graph, analysis)
    assert sorted(allowed) == [f"L{i}.ln2.out" for i in range(4)]
    assert not in_layer_boundaries(GRAPH, analyse(GRAPH, HW))  # GPT-2's boundary is a residual sum: 3 ops
    budget = int(0.5 * analysis.keep_all_peak_bytes)
    plan = get_planner("slackswap").plan(graph, HW, budget)
    assert set(allowed) & set(plan.tensors_with(Decision.RECOMPUTE))
    result = simulate(graph, plan, HW, budget)
    assert result.feasible and result.stall_s == 0.0


def test_slackswap_plan_says_why_each_tensor_is_swapped_or_recomputed(tmp_path):
    from slackswap.plan_io import read_plan_json, write_plan_json

    plan, _ = _plan_or_none("slackswap", 0.5)
    dropped = {t for t, d in plan.decisions.items() if d != Decision.KEEP}
    explained = set(plan.notes["why"])
    # Besides every dropped tensor, the swaps the budget did not need are explained as kept.
    returned = explained - dropped
    assert dropped and dropped <= explained and len(returned) == plan.notes.get("dropped_swaps", 0)
    assert all(plan.notes["why"][t].startswith(plan.decisions[t].value) for t in explained)
    assert all("the budget does not need its swap" in plan.notes["why"][t] for t in returned)
    assert plan.notes["swap_set"] in plan.notes["why"][plan.tensors_with(Decision.SWAP)[0]]
    write_plan_json(plan, tmp_path / "plan.json")
    assert read_plan_json(tmp_path / "plan.json").notes["why"] == plan.notes["why"]


def test_a_highs_failure_in_the_knapsack_is_a_solver_failure_not_an_infeasible_budget(monkeypatch):
    import types

    import slackswap.planners.strategies.recompute_knapsack as knapsack
    from slackswap.errors import SolverError

    failed = types.SimpleNamespace(success=False, status=1, message="time limit reached", x=None)
    monkeypatch.setattr(knapsack, "milp", lambda **_: failed)
    with pytest.raises(SolverError, match="HiGHS failed on the knapsack \\(status 1\\): time limit reached"):
        knapsack.solve_knapsack([10, 20], [1.0, 2.0], 15)
    assert not issubclass(SolverError, InfeasibleBudgetError)
