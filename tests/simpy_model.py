"""An independent SimPy model of the simulator's semantics (docs/simulation.md sections 1, 3, 4).

It shares nothing with the engine but the plan and graph types: it resolves copies by sequence
position itself, runs one process per stream, and grants memory in a low-priority "settle" event that
runs after every other event of the same instant (completions first, then allocation in plan order,
first fit). Setup is linear in the plan (transfers bucketed by issuing step), so it is a fair speed
peer for `benchmarks/bench_simulate.py` as well as the oracle of `tests/test_simulate_simpy.py`.
"""

from __future__ import annotations

import simpy

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan

SETTLE = 2  # lower priority than simpy's NORMAL (1): runs after all same-time completions


def resolve(graph: Graph, plan: Plan):
    """Copies by sequence position: (tensor, readers, offloaded) plus per-step reads/writes."""
    copies: list[dict] = []
    current: dict[str, int] = {}
    reads, writes = [], []
    off_copy, pre_copy = {}, {}
    offloads_after: dict[int, list[int]] = {}
    prefetches_after: dict[int, list[int]] = {}
    for k, tr in enumerate(plan.offloads):
        offloads_after.setdefault(tr.issue_after_step, []).append(k)
    for k, tr in enumerate(plan.prefetches):
        prefetches_after.setdefault(tr.issue_after_step, []).append(k)

    def transfers_after(i: int) -> None:
        for k in offloads_after.get(i, ()):
            off_copy[k] = current[plan.offloads[k].tensor]
        for k in prefetches_after.get(i, ()):
            copies.append({"tensor": plan.prefetches[k].tensor, "readers": 0, "offloaded": False})
            current[plan.prefetches[k].tensor] = pre_copy[k] = len(copies) - 1

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
    """(feasible, {(stream, index): (start_s, end_s)}, peak bytes) of `plan` under `budget`."""
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
