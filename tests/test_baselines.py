"""The published baselines as their papers run them: vDNN's stalls, Chen et al.'s sqrt(n) segments,
DTR's eviction heuristic, MEMO's swap fraction. Hand-worked toy graphs (link: 100 B/s, no latency)."""

from __future__ import annotations

import pytest

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.plan import Decision
from slackswap.planners.registry import get_planner
from slackswap.planners.strategies.full_recompute import segment_length
from slackswap.planners.strategies.memo import memo_alpha
from slackswap.planners.support.analysis import analyse, boundary_tensors
from slackswap.profile import build_graph
from slackswap.simulate import simulate, validate_plan
from slackswap.testing import bwd, fwd, make_graph, toy_hardware
from tests.test_planners import GRAPH, HW, PEAK, _model

TOY_HW = toy_hardware()


def test_swap_only_runs_and_stalls_where_the_offload_cannot_hide():
    # a (layer 0) and b (layer 1), 100 B each; the budget holds one. Offloading a takes 1 s: f2 waits
    # for it (0.1 -> 1.1), b2 runs 1.2-1.3, a's prefetch (issued one layer ahead, after f2) waits for
    # b to be freed at 1.3, copies until 2.3, b1 runs 2.3-2.4.
    g = make_graph(
        [fwd("f1", [], ["a"], 0.1, layer=0), fwd("f2", [], ["b"], 0.1, layer=1),
         bwd("b2", ["b"], ["gb"], 0.1, layer=1), bwd("b1", ["a"], ["ga"], 0.1, layer=0)],
        {"a": 100, "b": 100, "gb": 0, "ga": 0},
    )
    plan = get_planner("swap_only").plan(g, TOY_HW, 100)
    assert plan.tensors_with(Decision.SWAP) == ("a",) and plan.notes["offloaded_layers"] == 1
    result = simulate(g, plan, TOY_HW, 100)
    assert result.feasible and result.peak_activation_bytes <= 100
    assert result.step_s == pytest.approx(2.4)
    assert result.stall_memory_s == pytest.approx(1.0)
    with pytest.raises(InfeasibleBudgetError, match="wait for memory"):
        get_planner("swap_only", memory_waits=False).plan(g, TOY_HW, 100)
    with pytest.raises(ConfigError, match="memory_waits"):
        get_planner("swap_only", memory_waits="yes")


def test_swap_only_without_waits_matches_the_no_stall_rule_where_it_hides():
    plan = get_planner("swap_only").plan(GRAPH, HW, int(0.9 * PEAK))
    strict = get_planner("swap_only", memory_waits=False).plan(GRAPH, HW, int(0.9 * PEAK))
    assert plan.decisions == strict.decisions
    assert simulate(GRAPH, plan, HW, int(0.9 * PEAK)).stall_memory_s == 0.0


def test_full_recompute_sqrt_keeps_one_checkpoint_per_segment():
    g = build_graph(_model("tiny", num_layers=9, seq_len=64, micro_batch_size=1, hidden_size=64,
                           ffn_hidden_size=256), HW)
    assert segment_length(9) == 3 and segment_length(24) == 5 and segment_length(1) == 1
    plan = get_planner("full_recompute", segments="sqrt").plan(g, HW, None)
    every = get_planner("full_recompute").plan(g, HW, None)
    boundary = boundary_tensors(g)
    def layer(t):
        return g.op_by_name[g.tensors[t].producer].layer

    kept_in_stack = {t for t in plan.tensors_with(Decision.KEEP) if layer(t) >= 0}
    assert kept_in_stack and kept_in_stack <= boundary
    # the outputs of layers 2, 5 (entering segments 1 and 2) and 8 (entering the head)
    assert sorted(layer(t) for t in kept_in_stack) == [2, 5, 8]
    validate_plan(g, plan)
    sqrt_run, every_run = simulate(g, plan, HW, None), simulate(g, every, HW, None)
    # fewer checkpoints kept through the forward pass; the same forward ops re-run once each
    assert sqrt_run.recompute_s == pytest.approx(every_run.recompute_s, rel=0.05)
    with pytest.raises(ConfigError, match="segments"):
        get_planner("full_recompute", segments="cube_root")


def _dtr_toy():
    # f1 makes a (4 s), f2 makes b (1 s); f3 reads both; f4, f5 extend the chain; all 100 B.
    # At f5 (t=8) the device holds a, b, c, d and e = 500 B > 400: one eviction. d is f5's input;
    # c was last read at t=8 (staleness 0); a and b at t=6 (staleness 2):
    # h(a) = 4 / (100 * 2) > h(b) = 1 / (100 * 2), so DTR evicts b.
    return make_graph(
        [fwd("f1", [], ["a"], 4.0), fwd("f2", [], ["b"], 1.0), fwd("f3", ["a", "b"], ["c"], 1.0),
         fwd("f4", ["c"], ["d"], 2.0), fwd("f5", ["d"], ["e"], 1.0),
         bwd("g5", ["e"], ["ge"], 1.0), bwd("g4", ["d", "ge"], ["gd"], 1.0), bwd("g3", ["c", "gd"], ["gc"], 1.0),
         bwd("g2", ["a", "b", "gc"], ["ga"], 1.0)],
        {"a": 100, "b": 100, "c": 100, "d": 100, "e": 100, "ge": 0, "gd": 0, "gc": 0, "ga": 0},
    )


def test_dtr_evicts_the_tensor_of_least_cost_per_memory_and_staleness():
    g = _dtr_toy()
    plan = get_planner("dtr").plan(g, TOY_HW, 400)
    assert plan.tensors_with(Decision.RECOMPUTE) == ("b",)
    assert plan.notes["dtr_evictions"] == 1 and plan.notes["dtr_rounds"] == 0
    result = simulate(g, plan, TOY_HW, 400)
    assert result.feasible and result.stall_memory_s == 0.0 and result.recompute_s == pytest.approx(1.0)
    with pytest.raises(InfeasibleBudgetError, match="dtr"):
        get_planner("dtr").plan(g, TOY_HW, 150)  # f3 alone needs a, b and c


def test_memo_alpha_and_per_layer_swaps_fit_the_layer_compute():
    assert memo_alpha(1000, 2.0, 4.0, TOY_HW) == pytest.approx(0.2)  # 2 s x 100 B/s of 1000 B
    assert memo_alpha(1000, 20.0, 40.0, TOY_HW) == 1.0
    plan = get_planner("memo").plan(GRAPH, HW, None)
    info = analyse(GRAPH, HW).tensors
    for layer in range(GRAPH.num_layers):
        fwd_s = sum(op.duration_s for op in GRAPH.layer_ops(layer) if op.phase == "forward")
        dropped = [t for t, i in info.items() if i.layer == layer and not i.boundary and i.size_bytes > 0]
        assert dropped and all(plan.decisions[t] != Decision.KEEP for t in dropped)
        assert sum(info[t].d2h_s for t in dropped if plan.decisions[t] == Decision.SWAP) <= fwd_s
    assert all(plan.decisions[t] == Decision.KEEP for t in info if info[t].boundary)
