"""The eager runtime's own host costs on the CPU, measured once on the machine by a microbenchmark that
runs no plan and no model of the user's.

Why: an op-time table (`slackswap.runtime.op_times`) times the ops of a plain step, each *in context*
(the kernel and the module and autograd work that leads to it). A hook-only step of the runtime
(`slackswap.runtime.eager.hook_only`) does more than its ops: it runs in the runtime's context (entry
and exit, the model's input check, the step's report); for a plan that is not idle every saved tensor
passes the runtime's pack hook and its read-back the unpack hook (a table lookup, a shape and dtype
check, the plan's operations), and a recompute replays its op's recorded ATen calls from Python
(`PlanRun._recompute`: RNG fork, argument resolution over the recorded call's pytree, one ATen call
through its `OpOverload`). On the CPU at small shapes that host work is of the order of the ops' own
times and no op-time profile holds it. It is a property of the machine, Python and the PyTorch build,
as the op times are, so it is measured once, apart from any plan's step, and a prediction adds it per
step, per event, per recompute step and per replayed call the plan's hook-only step makes
(`slackswap.experiment.prediction.predict_step`, counted from the graph and the plan).

The microbenchmark: a fixed stack of `BLOCKS` small pre-norm MLP blocks (width `WIDTH`, `TOKENS`
tokens, dropout), captured, its op times measured as any model's. Its steps run in rounds, each kind
once a round, in rotating order (no kind always after the same one), timed whole on the thread's CPU
clock (other load and intra-op threads add nothing), medians over the rounds of differences within a
round:

- no hook (`bare`); the profile's pass-through hook (`pass`: `slackswap.runtime.op_times.as_captured`,
  the one the op times' plain steps run); a plan that keeps every tensor (`keep`: idle, no hook):
  `profile_hook_per_event_s` = (pass - bare) / events, `context_per_step_s` = keep - bare;
- the full-recompute plan (`recompute`: every decided tensor the planner can recompute recomputed)
  and a plan that keeps every decided tensor but one, recomputed (`one`: nearly every event returns its
  tensor as it is), each run with its recompute method wrapped in stamps: per plan, its step less the
  pass-through step, that step's replays and the context is hook work (a step's replays vary by 70-160
  us on the blocks' full recompute, so they are taken off the step they ran in; the stamps' own clock
  reads, about 1 us per recompute step, stay in the step), events of tensors not recomputed x
  `hook_per_event_s` + events of recomputed ones x `recompute_hook_per_event_s` (the events split by
  `slackswap.graph.saved_tensor_events`, as a prediction splits them); the two plans'
  equations solved by non-negative least squares;
- the `one` plan again with its module checks off (`one_unchecked`, `PlanRun.checks_modules`): the checks
  of a recomputing plan's step (`slackswap.runtime.eager.module_calls`) are `one` less `one_unchecked`,
  replays taken off both, taken off both recomputing plans' hook work before their equations are solved,
  and `module_check_per_call_s` is that over the blocks' calls of modules without children (the
  capture's `leaf_module_calls`);
- a plan that swaps every decided tensor (`swap`) and its copies alone (`copies`: `copy_` into a host
  buffer and `clone` back, as the link measurement times them, on buffers of the same sizes):
  `per_copy_s` = (swap - pass - context - events x `hook_per_event_s` - copies) / copies, >= 0: a swapped
  tensor's hook work beyond a kept one's is the copy's bookkeeping (on the blocks its events priced as a
  recomputed tensor's over-explain the swap's step);
- per recompute step j of the stamped full-recompute steps, its time minus the in-context time of the
  op it recomputes (what a prediction already counts for it), medians over the rounds; that excess as
  a + b * (ATen calls the step replays) by non-negative least squares, as the rates above:
  `replay_per_step_s`, `replay_per_call_s` (what a recompute step of an op without a measured replay
  time is priced at).

Why step differences, not stamps inside the hooks: a hook's callback into Python, autograd's handling
of a tensor handed back that is not the one it saved, and the context cost the step outside any stamp;
priced from stamps inside the hooks (1.0 us per event), the blocks' own full-recompute step came out
0.1-0.2 ms longer than its profile and replays said (docs/decisions/0025-runtime-host-costs-by-step.md).

The full-recompute plan is the caller's (`slackswap.experiment.measured_prediction.measure_host_costs`
passes the full_recompute planner's): the planners are a layer above the runtime.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import nnls

from slackswap.graph import LEAF_MODULE_CALLS_KEY, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.profile.measured import RuntimeHostCost

BLOCKS, WIDTH, TOKENS = 4, 64, 64
#: Rounds of steps per repeat asked for: a round's differences are tens to a few hundred microseconds
#: on steps of about 1.2-2.7 ms.
ROUNDS_PER_REPEAT = 9


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(4 * WIDTH, WIDTH), torch.nn.Dropout(0.1))
            for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@dataclass
class _Stamps:
    """Thread CPU seconds of a run's recomputes: per plan step over the steps, and this step's total."""

    per_step: dict = field(default_factory=dict)
    total_s: float = 0.0


def _stamped(run) -> _Stamps:
    """Wrap `run`'s recompute method in stamps (an instance attribute: the runtime looks it up on the
    instance) and return them."""
    stamps, recompute = _Stamps(), run._recompute

    def timed_recompute(j, reads=None):
        t0 = time.thread_time_ns()
        recompute(j, reads)
        dt = (time.thread_time_ns() - t0) / 1e9
        stamps.per_step.setdefault(j, []).append(dt)
        stamps.total_s += dt

    run._recompute = timed_recompute
    return stamps


def _one_recomputed(graph: Graph, full: Plan) -> Plan:
    """A plan that keeps every decided tensor but the first one `full` recomputes."""
    from slackswap.plan import Decision
    from slackswap.testing import schedule_from_decisions

    recomputed = [t for t, d in full.decisions.items() if d == Decision.RECOMPUTE]
    if not recomputed:
        raise RuntimeError("runtime host cost: the full-recompute plan recomputes no tensor of the blocks")
    decisions = {t: Decision.KEEP for t in full.decisions}
    return schedule_from_decisions(graph, decisions | {recomputed[0]: Decision.RECOMPUTE})


def measure_runtime_host_cost(full_recompute: Callable[[Graph, Hardware], Plan], warmup: int = 3,
                              repeats: int = 15) -> RuntimeHostCost:
    """`RuntimeHostCost` of this machine's CPU (module docstring). `full_recompute`: the full_recompute
    planner's plan of a graph (given by the caller: planners are a layer above the runtime). The RNG
    state is left as it was."""
    from slackswap.hardware import load_preset
    from slackswap.plan import Decision
    from slackswap.profile.measured import retime
    from slackswap.runtime import apply, capture_graph
    from slackswap.runtime.op_numbering import call_number
    from slackswap.runtime.op_times import as_captured, measure_op_times
    from slackswap.testing import schedule_from_decisions

    clock = "process" if torch.get_num_threads() == 1 else "wall"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Blocks()
        x = torch.randn(TOKENS, WIDTH)
        hardware = load_preset("h200_sxm_pcie5")  # only the capture's roofline, replaced below
        graph = capture_graph(model, (x,), _loss, hardware, "runtime host cost")
        table = measure_op_times(graph, model, (x,), _loss, warmup, repeats, clock)
        timed, _ = retime(graph, table)
        decided = list(timed.saved_tensors)
        plans = {"keep": schedule_from_decisions(timed, {t.name: Decision.KEEP for t in decided}),
                 "recompute": full_recompute(timed, hardware)}
        plans["one"] = _one_recomputed(timed, plans["recompute"])
        plans["swap"] = schedule_from_decisions(timed, {t.name: Decision.SWAP for t in decided})
        runs = {kind: apply(plan, timed, model) for kind, plan in plans.items()}
        runs["one_unchecked"] = apply(plans["one"], timed, model)
        runs["one_unchecked"].checks_modules = False  # the same steps without the module checks
        stamps = {kind: _stamped(runs[kind]) for kind in ("recompute", "one", "one_unchecked")}
        rounds = _rounds(model, x, timed, plans["swap"], runs, stamps, warmup, ROUNDS_PER_REPEAT * repeats,
                         as_captured)
        for run in runs.values():
            if run.report.verified:
                raise RuntimeError("runtime host cost: the microbenchmark's steps did not run hook-only "
                                   f"({run.report.hook_only_refusal})")
    costs = _solve(timed, plans, rounds)
    ops = {op.name: k for k, op in enumerate(timed.ops)}
    calls, excess = [], []
    for j, times in stamps["recompute"].per_step.items():
        op = plans["recompute"].steps[j].op
        k = ops[op]
        width = call_number(timed.ops[k + 1].name) - call_number(op) if k + 1 < len(timed.ops) else 1
        calls.append(width)
        excess.append(statistics.median(times[-len(rounds):]) - timed.ops[k].duration_s)
    # a + b x >= 0 by non-negative least squares, as the events' rates (`_solve`).
    (per_step, per_call), _ = nnls(np.stack([np.ones(len(calls)), np.array(calls, float)], axis=1),
                                   np.array(excess, float))
    events = int(timed.meta["saved_tensor_packs"]) + int(timed.meta["saved_tensor_unpacks"])
    copies = len(plans["swap"].offloads) + len(plans["swap"].prefetches)
    source = (f"slackswap.runtime.eager.host_cost: {BLOCKS} pre-norm MLP blocks (width {WIDTH}, {TOKENS} tokens), "
              f"{events} saved-tensor events a step; steps with no hook, the profile's pass-through hook, the keep "
              f"plan, the full-recompute plan ({len(calls)} recompute steps of {min(calls)}-{max(calls)} ATen calls), "
              f"a plan recomputing one tensor (with and without its module checks, {timed.meta[LEAF_MODULE_CALLS_KEY]} "
              f"calls) and one swapping every tensor ({copies} copies), {len(rounds)} rounds "
              f"in rotating order, thread CPU time, medians of differences within a round; op times by the {clock} "
              f"clock; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    return RuntimeHostCost(hook_per_event_s=costs["other"], replay_per_step_s=float(per_step),
                           replay_per_call_s=float(per_call),
                           per_copy_s=costs["copy"], context_per_step_s=costs["context"],
                           profile_hook_per_event_s=costs["profile_hook"],
                           recompute_hook_per_event_s=costs["recomputed"],
                           module_check_per_call_s=costs["module_check"], source=source)


def _rounds(model, x, graph: Graph, swap: Plan, runs: dict, stamps: dict, warmup: int, rounds: int,
            pass_through) -> list[dict[str, float]]:
    """Per round after `warmup` rounds (and each run's first, verified step): thread CPU seconds of a step
    of each kind (module docstring), and of the replays in the step of each stamped run (`<kind>_replays`)."""
    sizes = graph.size_bytes_of
    buffers = [(torch.ones(sizes[t.tensor], dtype=torch.uint8), torch.empty(sizes[t.tensor], dtype=torch.uint8))
               for t in swap.offloads]

    def copies() -> None:  # the swap's offloads and their reloads alone
        for src, host in buffers:
            host.copy_(src)
            host.clone()

    contexts = {"bare": contextlib.nullcontext, "pass": pass_through,
                **{kind: (lambda run=run: run) for kind, run in runs.items()}}
    kinds = (*contexts, "copies")

    def step(kind: str) -> float:
        for p in model.parameters():
            p.grad = None
        c0 = time.thread_time_ns()
        if kind == "copies":
            copies()
        else:
            with contexts[kind]():
                _loss(model(x)).backward()
        return (time.thread_time_ns() - c0) / 1e9

    out = []
    for i in range(1 + warmup + rounds):  # a run's first step is its verified one
        t = {}
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            for s in stamps.values():
                s.total_s = 0.0
            t[kind] = step(kind)
            if kind in stamps:
                t[f"{kind}_replays"] = stamps[kind].total_s
        if i > warmup:
            out.append(t)
    return out


def _solve(graph: Graph, plans: dict[str, Plan], rounds: list[dict[str, float]]) -> dict[str, float]:
    """The per-step, per-event and per-copy costs from the rounds' step times (module docstring), each >= 0."""
    from slackswap.graph import saved_tensor_events
    from slackswap.plan import Decision

    def median(f) -> float:
        return statistics.median(f(t) for t in rounds)

    events = int(graph.meta["saved_tensor_packs"]) + int(graph.meta["saved_tensor_unpacks"])
    context = max(0.0, median(lambda t: t["keep"] - t["bare"]))
    profile_hook = max(0.0, median(lambda t: t["pass"] - t["bare"]) / max(1, events))
    checks = max(0.0, median(lambda t: t["one"] - t["one_replays"] - t["one_unchecked"] + t["one_unchecked_replays"]))
    rows, hook_work = [], []
    for kind in ("recompute", "one"):  # both recompute, so both check their module calls
        recomputed = saved_tensor_events(graph, plans[kind].tensors_with(Decision.RECOMPUTE))
        rows.append([events - recomputed, recomputed])
        hook_work.append(median(lambda t, k=kind: t[k] - t["pass"] - t[f"{k}_replays"] - (t["keep"] - t["bare"]))
                         - checks)
    (other, recomputed_rate), _ = nnls(np.array(rows, float), np.array(hook_work, float))
    copies = len(plans["swap"].offloads) + len(plans["swap"].prefetches)
    swap_extra = median(lambda t: t["swap"] - t["pass"] - (t["keep"] - t["bare"]) - t["copies"])
    per_copy = (swap_extra - events * other) / max(1, copies)
    return {"context": context, "profile_hook": profile_hook, "other": float(other),
            "recomputed": float(recomputed_rate), "copy": max(0.0, float(per_copy)),
            "module_check": checks / max(1, int(graph.meta[LEAF_MODULE_CALLS_KEY]))}


__all__ = ["measure_runtime_host_cost"]
