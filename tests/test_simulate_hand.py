"""Exact event logs for tiny hand-made graphs. Every expected time is worked out by hand below.

Link: 100 B/s per direction, zero latency (unless a test says otherwise), so a 100-byte copy takes
1 s. Durations and sizes are chosen so every time is exact in binary floating point.
"""

from __future__ import annotations

import pytest

from slackswap.errors import ConfigError
from slackswap.plan import ComputeStep, Decision, Direction, Plan, StepKind, Transfer
from slackswap.schedule.build import keep_all_plan
from slackswap.simulate import simulate
from slackswap.testing import bwd, fwd, make_graph, toy_hardware

HW = toy_hardware()


def three_layer_graph(a: int = 100, b: int = 200, c: int = 50, f3_s: float = 4.0):
    """F1 -> a -> F2 -> b -> F3 -> c; backward B3(c) -> g2, B2(g2, b) -> g1, B1(g1, a)."""
    return make_graph(
        [
            fwd("F1", (), ("a",), 1.0),
            fwd("F2", ("a",), ("b",), 1.0),
            fwd("F3", ("b",), ("c",), f3_s),
            bwd("B3", ("c",), ("g2",), 1.0),
            bwd("B2", ("g2", "b"), ("g1",), 1.0),
            bwd("B1", ("g1", "a"), (), 1.0),
        ],
        {"a": a, "b": b, "c": c, "g2": 10, "g1": 10},
    )


def run_steps(graph, recompute_before: dict[str, tuple[str, tuple[str, ...]]] | None = None):
    steps = []
    for op in graph.ops:
        if recompute_before and op.name in recompute_before:
            producer, outs = recompute_before[op.name]
            steps.append(ComputeStep(producer, StepKind.RECOMPUTE, outs))
        steps.append(ComputeStep(op.name, StepKind.RUN, op.outputs))
    return tuple(steps)


def swap_a_plan(graph, offload_after: int, prefetch_after: int) -> Plan:
    decisions = {t.name: Decision.KEEP for t in graph.saved_tensors}
    decisions["a"] = Decision.SWAP
    return Plan(
        planner="hand",
        budget_bytes=None,
        decisions=decisions,
        steps=run_steps(graph),
        offloads=(Transfer("a", Direction.D2H, offload_after),),
        prefetches=(Transfer("a", Direction.H2D, prefetch_after),),
    )


def log(result):
    """(stream, kind, name, start, end) per event, streams in a fixed order, each by start time."""
    order = {"compute": 0, "d2h": 1, "h2d": 2}
    events = sorted(result.events, key=lambda e: (order[e.stream], e.start_s, e.index))
    return [(e.stream, e.kind, e.op or e.tensor, e.start_s, e.end_s) for e in events]


def memory(result):
    return list(zip(result.memory_times_s, result.memory_bytes, strict=True))


def waits(result):
    return {e.op: (e.wait_prefetch_s, e.wait_memory_s) for e in result.events if e.stream == "compute"}


def test_keep_all_runs_back_to_back_and_frees_after_last_reader():
    g = three_layer_graph()
    r = simulate(g, keep_all_plan(g), HW, None)
    assert log(r) == [
        ("compute", "run", "F1", 0.0, 1.0),
        ("compute", "run", "F2", 1.0, 2.0),
        ("compute", "run", "F3", 2.0, 6.0),
        ("compute", "run", "B3", 6.0, 7.0),
        ("compute", "run", "B2", 7.0, 8.0),
        ("compute", "run", "B1", 8.0, 9.0),
    ]
    # a+b+c+g2 = 360 at B3's start; c freed after B3; g2 and b after B2; g1 and a after B1.
    assert memory(r) == [
        (0.0, 0),
        (0.0, 100),
        (1.0, 300),
        (2.0, 350),
        (6.0, 360),
        (7.0, 310),
        (7.0, 320),
        (8.0, 310),
        (8.0, 110),
        (9.0, 100),
        (9.0, 0),
    ]
    assert r.step_s == 9.0 and r.peak_activation_bytes == 360 and r.stall_s == 0.0


def test_transfer_that_hides_fully():
    # Offload of a (100 B, 1 s) issued when F1 ends at 1: d2h [1, 2]. a's original copy is freed at 2,
    # when both F2 (its last forward reader) and the offload are done. Prefetch issued when F3 ends at
    # 6: h2d [6, 7]; B1 starts at 8 as in keep-all, so nothing stalls.
    g = three_layer_graph()
    r = simulate(g, swap_a_plan(g, offload_after=0, prefetch_after=2), HW, None)
    assert log(r) == [
        ("compute", "run", "F1", 0.0, 1.0),
        ("compute", "run", "F2", 1.0, 2.0),
        ("compute", "run", "F3", 2.0, 6.0),
        ("compute", "run", "B3", 6.0, 7.0),
        ("compute", "run", "B2", 7.0, 8.0),
        ("compute", "run", "B1", 8.0, 9.0),
        ("d2h", "offload", "a", 1.0, 2.0),
        ("h2d", "prefetch", "a", 6.0, 7.0),
    ]
    assert memory(r) == [
        (0.0, 0),
        (0.0, 100),
        (1.0, 300),
        (2.0, 200),
        (2.0, 250),
        (6.0, 350),
        (6.0, 360),
        (7.0, 310),
        (7.0, 320),
        (8.0, 310),
        (8.0, 110),
        (9.0, 100),
        (9.0, 0),
    ]
    assert r.step_s == 9.0 and r.stall_s == 0.0
    assert (r.d2h_bytes, r.h2d_bytes, r.d2h_busy_s, r.h2d_busy_s) == (100, 100, 1.0, 1.0)
    assert r.swapped_tensors == 1 and r.recomputed_tensors == 0


def test_late_prefetch_stalls_its_consumer():
    # Prefetch issued only when B2 ends at 8: h2d [8, 9]. B1 was ready at 8, so it waits 1 s for it.
    g = three_layer_graph()
    r = simulate(g, swap_a_plan(g, offload_after=0, prefetch_after=4), HW, None)
    assert log(r)[-3:] == [
        ("compute", "run", "B1", 9.0, 10.0),
        ("d2h", "offload", "a", 1.0, 2.0),
        ("h2d", "prefetch", "a", 8.0, 9.0),
    ]
    assert waits(r)["B1"] == (1.0, 0.0)
    assert r.step_s == 10.0 and r.stall_prefetch_s == 1.0 and r.stall_memory_s == 0.0


def test_prefetch_waits_for_its_offload_and_stalls_backward():
    # a = 400 B: offload d2h [1, 5]. F3 (0.5 s) ends at 2.5; the prefetch is issued then but must wait
    # for the host copy: h2d [5, 9]. B3 [2.5, 3.5], B2 [3.5, 4.5], B1 waits 4.5 s: [9, 10].
    g = three_layer_graph(a=400, f3_s=0.5)
    r = simulate(g, swap_a_plan(g, offload_after=0, prefetch_after=2), HW, None)
    assert log(r) == [
        ("compute", "run", "F1", 0.0, 1.0),
        ("compute", "run", "F2", 1.0, 2.0),
        ("compute", "run", "F3", 2.0, 2.5),
        ("compute", "run", "B3", 2.5, 3.5),
        ("compute", "run", "B2", 3.5, 4.5),
        ("compute", "run", "B1", 9.0, 10.0),
        ("d2h", "offload", "a", 1.0, 5.0),
        ("h2d", "prefetch", "a", 5.0, 9.0),
    ]
    assert waits(r)["B1"] == (4.5, 0.0)
    assert r.step_s == 10.0 and r.stall_prefetch_s == 4.5


def test_allocation_waits_for_an_offload():
    # a = 300, b = 200, c = 100, budget 560. d2h of a [1, 4].
    # t=1: F2 allocates b -> 500. t=2: F2 done but a stays until its offload ends; F3 needs c: 600 > 560.
    # t=4: offload done, a freed -> 200; F3 allocates c -> 300 and runs [4, 8] (2 s memory wait).
    # t=8: prefetch of a needs 300 -> 600 > 560 and waits; B3 allocates g2 (10 B) -> 310, runs [8, 9].
    # t=9: c freed -> 210; prefetch allocates -> 510, h2d [9, 12]; B2 allocates g1 -> 520, runs [9, 10].
    # t=10: g2 and b freed -> 310. B1 waits for the prefetch until 12 (2 s), runs [12, 13].
    g = three_layer_graph(a=300, b=200, c=100)
    r = simulate(g, swap_a_plan(g, offload_after=0, prefetch_after=2), HW, 560)
    assert log(r) == [
        ("compute", "run", "F1", 0.0, 1.0),
        ("compute", "run", "F2", 1.0, 2.0),
        ("compute", "run", "F3", 4.0, 8.0),
        ("compute", "run", "B3", 8.0, 9.0),
        ("compute", "run", "B2", 9.0, 10.0),
        ("compute", "run", "B1", 12.0, 13.0),
        ("d2h", "offload", "a", 1.0, 4.0),
        ("h2d", "prefetch", "a", 9.0, 12.0),
    ]
    assert memory(r) == [
        (0.0, 0),
        (0.0, 300),
        (1.0, 500),
        (4.0, 200),
        (4.0, 300),
        (8.0, 310),
        (9.0, 210),
        (9.0, 510),
        (9.0, 520),
        (10.0, 510),
        (10.0, 310),
        (13.0, 300),
        (13.0, 0),
    ]
    assert waits(r)["F3"] == (0.0, 2.0) and waits(r)["B1"] == (2.0, 0.0)
    assert (r.stall_memory_s, r.stall_prefetch_s, r.step_s, r.peak_activation_bytes) == (2.0, 2.0, 13.0, 520)
    assert max(r.memory_bytes) <= 560


def test_recompute_step_before_its_backward_reader():
    # b is recomputed by re-running F2 (1 s) right before B2. The original b is freed when F3 (its last
    # reader) ends at 6; the recomputed b' (200 B) is allocated at 7 and freed after B2 at 9.
    g = three_layer_graph()
    decisions = {t.name: Decision.KEEP for t in g.saved_tensors}
    decisions["b"] = Decision.RECOMPUTE
    plan = Plan("hand", None, decisions, run_steps(g, {"B2": ("F2", ("b",))}))
    r = simulate(g, plan, HW, None)
    assert log(r) == [
        ("compute", "run", "F1", 0.0, 1.0),
        ("compute", "run", "F2", 1.0, 2.0),
        ("compute", "run", "F3", 2.0, 6.0),
        ("compute", "run", "B3", 6.0, 7.0),
        ("compute", "recompute", "F2", 7.0, 8.0),
        ("compute", "run", "B2", 8.0, 9.0),
        ("compute", "run", "B1", 9.0, 10.0),
    ]
    assert memory(r) == [
        (0.0, 0),
        (0.0, 100),
        (1.0, 300),
        (2.0, 350),
        (6.0, 150),
        (6.0, 160),
        (7.0, 110),
        (7.0, 310),
        (8.0, 320),
        (9.0, 310),
        (9.0, 110),
        (10.0, 100),
        (10.0, 0),
    ]
    assert (r.step_s, r.recompute_s, r.peak_activation_bytes, r.recomputed_tensors) == (10.0, 1.0, 350, 1)


def test_budget_too_small_for_one_step_is_infeasible_and_named():
    # F1 allocates a (100). F2 needs b (200): 300 > 250 and nothing is in flight once F1 ends at 1.
    g = three_layer_graph()
    r = simulate(g, keep_all_plan(g), HW, 250)
    assert not r.feasible and r.step_s is None
    inf = r.infeasibility
    assert (inf.request, inf.tensors, inf.step, inf.op) == ("step", ("b",), 1, "F2")
    assert (inf.needed_bytes, inf.in_use_bytes, inf.budget_bytes, inf.time_s) == (200, 100, 250, 1.0)
    for part in ("'b'", "step 1", "'F2'", "200 bytes", "100 bytes in use", "budget of 250 bytes"):
        assert part in r.infeasible_reason
    assert log(r) == [("compute", "run", "F1", 0.0, 1.0)]
    assert max(r.memory_bytes) <= 250


def test_prefetch_that_can_never_fit_is_infeasible_and_named():
    # F1 -> a (300), F2(a) -> x (10), F3(x) -> b (250), B(a, b). Swap a, budget 400.
    # d2h of a [1, 4]; F3 waits for memory until a is freed at 4 (in use 10 -> 260), runs [4, 5];
    # x freed at 5 -> 250. The prefetch (issued after F3) needs 300: 550 > 400, B waits for it, and
    # nothing is in flight: deadlock at t=5 naming the prefetch of a.
    g = make_graph(
        [
            fwd("F1", (), ("a",), 1.0),
            fwd("F2", ("a",), ("x",), 1.0),
            fwd("F3", ("x",), ("b",), 1.0),
            bwd("B", ("a", "b"), (), 1.0),
        ],
        {"a": 300, "x": 10, "b": 250},
    )
    plan = Plan(
        "hand",
        None,
        {"a": Decision.SWAP, "b": Decision.KEEP},
        run_steps(g),
        offloads=(Transfer("a", Direction.D2H, 0),),
        prefetches=(Transfer("a", Direction.H2D, 2),),
    )
    r = simulate(g, plan, HW, 400)
    assert not r.feasible
    inf = r.infeasibility
    assert (inf.request, inf.tensors, inf.step, inf.op, inf.needed_bytes, inf.in_use_bytes, inf.time_s) == (
        "prefetch",
        ("a",),
        3,
        "B",
        300,
        250,
        5.0,
    )
    assert "prefetch of tensor 'a'" in r.infeasible_reason and "budget of 400 bytes" in r.infeasible_reason
    assert log(r) == [
        ("compute", "run", "F1", 0.0, 1.0),
        ("compute", "run", "F2", 1.0, 2.0),
        ("compute", "run", "F3", 4.0, 5.0),
        ("d2h", "offload", "a", 1.0, 4.0),
    ]
    assert memory(r) == [(0.0, 0), (0.0, 300), (1.0, 310), (4.0, 10), (4.0, 260), (5.0, 250)]


def test_latency_and_shared_bandwidth_of_two_engines():
    # Two swapped tensors, two d2h engines sharing 100 B/s (50 B/s each), latency 0.5 s:
    # each 100-byte offload takes 0.5 + 100 / 50 = 2.5 s, and both run at once on engines 0 and 1.
    g = make_graph(
        [fwd("F1", (), ("a", "b"), 1.0), fwd("F2", ("a",), ("c",), 8.0), bwd("B", ("a", "b", "c"), (), 1.0)],
        {"a": 100, "b": 100, "c": 10},
    )
    hw = toy_hardware(latency_s=0.5, d2h_engines=2)
    plan = Plan(
        "hand",
        None,
        {"a": Decision.SWAP, "b": Decision.SWAP, "c": Decision.KEEP},
        run_steps(g),
        offloads=(Transfer("a", Direction.D2H, 0), Transfer("b", Direction.D2H, 0)),
        prefetches=(Transfer("a", Direction.H2D, 1), Transfer("b", Direction.H2D, 1)),
    )
    r = simulate(g, plan, hw, None)
    d2h = [(e.tensor, e.engine, e.start_s, e.end_s) for e in r.stream_events("d2h")]
    assert d2h == [("a", 0, 1.0, 3.5), ("b", 1, 1.0, 3.5)]
    # One h2d engine at the full 100 B/s: 0.5 + 1 = 1.5 s each, back to back after F2 ends at 9.
    h2d = [(e.tensor, e.start_s, e.end_s) for e in r.stream_events("h2d")]
    assert h2d == [("a", 9.0, 10.5), ("b", 10.5, 12.0)]
    assert r.d2h_busy_s == 2.5 and r.h2d_busy_s == 3.0 and r.step_s == 13.0


def test_bad_budget_is_rejected():
    g = three_layer_graph()
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ConfigError, match="budget_bytes"):
            simulate(g, keep_all_plan(g), HW, bad)
