"""`SimResult.events` is an `EventLog`: the engine records a few numbers per event and the TraceEvents
are built on first use. These tests hold the built sequence to hand-worked events, in the order the
events started across streams (tests/test_simulate_hand.py checks each stream on its own), and check
that it behaves as the tuple it replaced: length, indexing, equality and hashing by value."""

from __future__ import annotations

import copy
import pickle

from slackswap.plan import ComputeStep, Decision, Direction, Plan, StepKind, Transfer
from slackswap.simulate import TraceEvent, simulate
from slackswap.testing import bwd, fwd, make_graph, toy_hardware
from tests.test_simulate_hand import swap_a_plan, three_layer_graph

HW = toy_hardware()  # 100 B/s per direction, no latency: a 100-byte copy takes 1 s
_graph = three_layer_graph  # a (100 B), b (200 B), c (50 B); F3 takes 4 s, every other op 1 s
_swap_a = swap_a_plan


def _run(step: int, op: str, start: float, end: float, size: int, wait_prefetch: float = 0.0,
         wait_memory: float = 0.0) -> TraceEvent:
    return TraceEvent("compute", "run", step, start, end, op, "", size, 0, wait_prefetch, wait_memory)


def test_events_come_in_the_order_they_started_with_every_field():
    # F1 runs [0, 1]. At t=1 the offload of a (issued after step 0) starts before F2 (offloads first
    # at an instant): d2h [1, 2]. F3 [2, 6]. At t=6 the prefetch (issued after step 2) starts before
    # B3 (a prefetch issued after an earlier step comes first in plan order): h2d [6, 7]. B2 [7, 8],
    # B1 [8, 9] reads the prefetched copy, ready at 7: no wait.
    g = _graph()
    r = simulate(g, _swap_a(g, offload_after=0, prefetch_after=2), HW, None)
    assert list(r.events) == [
        _run(0, "F1", 0.0, 1.0, 100),
        TraceEvent("d2h", "offload", 0, 1.0, 2.0, "", "a", 100, 0, 0.0, 0.0),
        _run(1, "F2", 1.0, 2.0, 200),
        _run(2, "F3", 2.0, 6.0, 50),
        TraceEvent("h2d", "prefetch", 0, 6.0, 7.0, "", "a", 100, 0, 0.0, 0.0),
        _run(3, "B3", 6.0, 7.0, 10),
        _run(4, "B2", 7.0, 8.0, 10),
        _run(5, "B1", 8.0, 9.0, 0),
    ]


def test_a_late_prefetch_wait_is_recorded_on_the_waiting_step():
    # Offload after F3 (t=6): d2h [6, 7], started before B3 [6, 7]. B2 [7, 8]. The prefetch, issued
    # after B2 (t=8), has its offload done: h2d [8, 9], started before B1 tries. B1 reads the
    # prefetched copy, ready at 9: it runs [9, 10] after waiting 1 s for it.
    g = _graph()
    r = simulate(g, _swap_a(g, offload_after=2, prefetch_after=4), HW, None)
    assert r.events[-1] == _run(5, "B1", 9.0, 10.0, 0, wait_prefetch=1.0)
    assert [(e.stream, e.start_s) for e in r.events] == [
        ("compute", 0.0), ("compute", 1.0), ("compute", 2.0), ("d2h", 6.0), ("compute", 6.0), ("compute", 7.0),
        ("h2d", 8.0), ("compute", 9.0),
    ]


def test_an_infeasible_run_holds_only_the_events_that_started():
    # F1 -> a (300), F2(a) -> x (10), F3(x) -> b (250), B(a, b); swap a under 400 bytes.
    # d2h of a [1, 4]; F3 waits for memory from 2 until a is freed at 4 and runs [4, 5]. The prefetch
    # (after F3) needs 300 with 250 in use: deadlock at 5, so B and the prefetch never start.
    g = make_graph(
        [fwd("F1", (), ("a",), 1.0), fwd("F2", ("a",), ("x",), 1.0), fwd("F3", ("x",), ("b",), 1.0),
         bwd("B", ("a", "b"), (), 1.0)],
        {"a": 300, "x": 10, "b": 250},
    )
    plan = Plan(
        "hand", None, {"a": Decision.SWAP, "b": Decision.KEEP},
        tuple(ComputeStep(op.name, StepKind.RUN, op.outputs) for op in g.ops),
        offloads=(Transfer("a", Direction.D2H, 0),),
        prefetches=(Transfer("a", Direction.H2D, 2),),
    )
    r = simulate(g, plan, HW, 400)
    assert not r.feasible
    assert list(r.events) == [
        _run(0, "F1", 0.0, 1.0, 300),
        TraceEvent("d2h", "offload", 0, 1.0, 4.0, "", "a", 300, 0, 0.0, 0.0),
        _run(1, "F2", 1.0, 2.0, 10),
        _run(2, "F3", 4.0, 5.0, 250, wait_memory=2.0),
    ]


def test_the_log_behaves_as_the_tuple_of_its_events():
    g = _graph()
    plan = _swap_a(g, offload_after=0, prefetch_after=2)
    r = simulate(g, plan, HW, None)
    assert len(r.events) == 8
    assert r.events._events is None  # counting them built nothing
    built = tuple(r.events)
    assert r.events == built and built == r.events and r.events[1:3] == built[1:3] and r.events[-1] == built[-1]
    assert hash(r.events) == hash(built)
    again = simulate(g, plan, HW, None)
    assert again.events == r.events and again == r and hash(again) == hash(r)
    other = simulate(g, _swap_a(g, offload_after=0, prefetch_after=3), HW, None)
    assert other.events != r.events and other != r
    assert "TraceEvent(stream='d2h'" in repr(r.events)
    fresh = simulate(g, plan, HW, None)  # events not built yet: the record itself must travel
    assert pickle.loads(pickle.dumps(fresh)) == r and copy.deepcopy(fresh) == r
