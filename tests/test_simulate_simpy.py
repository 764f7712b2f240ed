"""Cross-check the heapq engine against an independent SimPy model of the same schedule semantics.

The SimPy model shares nothing with the engine but the plan and graph types: it resolves copies by
sequence position itself, runs one process per stream, and grants memory in a low-priority
"settle" event that runs after every other event of the same instant (completions first, then
allocation in plan order, first fit), which is the semantics docs/simulation.md states.
"""

from __future__ import annotations

import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.simulate import simulate
from slackswap.testing import random_graph, random_valid_plan, toy_hardware

SETTLE = 2  # lower priority than simpy's NORMAL (1): runs after all same-time completions


def resolve(graph: Graph, plan: Plan):
    """Copies by sequence position: (tensor, source, index) plus readers, per-step reads/writes."""
    copies: list[dict] = []
    current: dict[str, int] = {}
    reads, writes = [], []
    off_copy, pre_copy = {}, {}

    def transfers_after(i: int) -> None:
        for k, tr in enumerate(plan.offloads):
            if tr.issue_after_step == i:
                off_copy[k] = current[tr.tensor]
        for k, tr in enumerate(plan.prefetches):
            if tr.issue_after_step == i:
                copies.append({"tensor": tr.tensor, "readers": 0, "offloaded": False})
                current[tr.tensor] = pre_copy[k] = len(copies) - 1

    transfers_after(-1)
    for j, step in enumerate(plan.steps):
        op = graph.op_by_name[step.op]
        r = []
        for t in dict.fromkeys(op.inputs):
            copies[current[t]]["readers"] += 1
            r.append(current[t])
        w = []
        for t in step.outputs:
            copies.append({"tensor": t, "readers": 0, "offloaded": False})
            current[t] = len(copies) - 1
            w.append(current[t])
        reads.append(r)
        writes.append(w)
        transfers_after(j)
    for c in off_copy.values():
        copies[c]["offloaded"] = True
    return copies, reads, writes, off_copy, pre_copy


def simpy_model(graph: Graph, plan: Plan, hw: Hardware, budget: int | None):
    env = simpy.Environment()
    copies, reads, writes, off_copy, pre_copy = resolve(graph, plan)
    size = [graph.tensors[c["tensor"]].size_bytes for c in copies]
    left = [c["readers"] for c in copies]
    off_pending = [c["offloaded"] for c in copies]
    ready = [env.event() for _ in copies]
    freed = [False] * len(copies)
    step_done = [env.event() for _ in plan.steps]
    off_done = [env.event() for _ in plan.offloads]
    events: dict[tuple[str, int], tuple[float, float]] = {}
    mem = {"used": 0, "peak": 0, "pending": [], "scheduled": False}
    cap = float("inf") if budget is None else budget

    def settle(_event) -> None:
        mem["scheduled"] = False
        waiting = []
        for key, n, ev in sorted(mem["pending"], key=lambda p: p[0]):
            if mem["used"] + n <= cap:
                mem["used"] += n
                mem["peak"] = max(mem["peak"], mem["used"])
                ev.succeed()
            else:
                waiting.append((key, n, ev))
        mem["pending"] = waiting

    def schedule_settle() -> None:
        if not mem["scheduled"]:
            mem["scheduled"] = True
            ev = simpy.Event(env)
            ev._ok, ev._value = True, None
            ev.callbacks.append(settle)
            env.schedule(ev, priority=SETTLE)

    def allocate(key, n):
        ev = env.event()
        mem["pending"].append((key, n, ev))
        schedule_settle()
        return ev

    def maybe_free(c: int) -> None:
        if ready[c].triggered and left[c] == 0 and not off_pending[c] and not freed[c]:
            freed[c] = True
            mem["used"] -= size[c]
            schedule_settle()

    def compute():
        for j, step in enumerate(plan.steps):
            for c in reads[j]:
                yield ready[c]
            yield allocate((j, 0, 0), sum(size[c] for c in writes[j]))
            start = env.now
            yield env.timeout(graph.op_by_name[step.op].duration_s)
            events["compute", j] = (start, env.now)
            for c in writes[j]:
                ready[c].succeed()
            for c in reads[j]:
                left[c] -= 1
                maybe_free(c)
            for c in writes[j]:
                maybe_free(c)
            step_done[j].succeed()

    def copy_job(kind, k, c, seconds, engines, req):
        start = env.now
        yield env.timeout(seconds)
        events[kind, k] = (start, env.now)
        engines.release(req)
        if kind == "d2h":
            off_pending[c] = False
            off_done[k].succeed()
        else:
            ready[c].succeed()
        maybe_free(c)

    def offloads(engines):
        per_engine = hw.link.d2h_effective_bytes_per_s / hw.link.d2h_engines
        for k, tr in enumerate(plan.offloads):
            if tr.issue_after_step >= 0:
                yield step_done[tr.issue_after_step]
            req = engines.request()
            yield req
            c = off_copy[k]
            env.process(copy_job("d2h", k, c, hw.link.latency_s + size[c] / per_engine, engines, req))

    def prefetches(engines):
        per_engine = hw.link.h2d_effective_bytes_per_s / hw.link.h2d_engines
        offload_of = {tr.tensor: k for k, tr in enumerate(plan.offloads)}
        for k, tr in enumerate(plan.prefetches):
            if tr.issue_after_step >= 0:
                yield step_done[tr.issue_after_step]
            yield off_done[offload_of[tr.tensor]]
            req = engines.request()
            yield req
            c = pre_copy[k]
            yield allocate((tr.issue_after_step, 1, k), size[c])
            env.process(copy_job("h2d", k, c, hw.link.latency_s + size[c] / per_engine, engines, req))

    env.process(compute())
    env.process(offloads(simpy.Resource(env, hw.link.d2h_engines)))
    env.process(prefetches(simpy.Resource(env, hw.link.h2d_engines)))
    env.run()
    feasible = all(ev.triggered for ev in step_done)
    return feasible, events, mem["peak"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rng=st.randoms(use_true_random=False),
    layers=st.integers(1, 5),
    bw=st.sampled_from([(100.0, 100.0), (50.0, 400.0), (1000.0, 200.0)]),
    latency=st.sampled_from([0.0, 0.25]),
    engines=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]),
    fraction=st.sampled_from([None, 0.4, 0.6, 0.8, 1.0]),
)
def test_engine_matches_simpy_model(rng, layers, bw, latency, engines, fraction):
    graph = random_graph(rng, max_layers=layers)
    plan = random_valid_plan(graph, rng)
    hw = toy_hardware(bw[0], bw[1], latency, engines[0], engines[1])
    budget = None if fraction is None else int(simulate(graph, plan, hw, None).peak_activation_bytes * fraction)
    result = simulate(graph, plan, hw, budget)
    feasible, events, peak = simpy_model(graph, plan, hw, budget)
    assert result.feasible == feasible
    assert result.peak_activation_bytes == peak
    ours = {(e.stream, e.index): (e.start_s, e.end_s) for e in result.events}
    assert ours.keys() == events.keys()
    for key, (start, end) in events.items():
        assert ours[key] == pytest.approx((start, end), rel=1e-12, abs=1e-12), key
    if feasible:
        assert result.step_s == pytest.approx(max(end for _, end in events.values()), rel=1e-12)
