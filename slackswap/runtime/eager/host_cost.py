"""The eager runtime's own host costs on the CPU, measured once on the machine by a microbenchmark that
runs no plan and no model of the user's.

Why: an op-time table (`slackswap.runtime.op_times`) times the ops of a plain step, each *in context*
(the kernel and the module and autograd work that leads to it). A hook-only step of the runtime
(`slackswap.runtime.eager.hook_only`) does more than its ops: for a plan that is not idle every
saved tensor passes the runtime's pack hook and its read-back the unpack hook (a table lookup, a
shape and dtype check, the plan's operations), and a recompute replays its op's recorded ATen calls
from Python (`PlanRun._recompute`: RNG fork, argument resolution over the recorded call's pytree,
one ATen call through its `OpOverload`). On the CPU at small shapes that host work is of the order
of the ops' own times and no op-time profile holds it. It is a property of the machine, Python and
the PyTorch build, as the op times are, so it is measured once, apart from any plan's step, and a
prediction adds it per event, per recompute step and per replayed call the plan's hook-only step
makes (`slackswap.experiment.prediction.predict_step`, counted from the graph and the plan).

The microbenchmark: a fixed stack of `BLOCKS` small pre-norm MLP blocks (width `WIDTH`, `TOKENS`
tokens, dropout), captured, its op times measured as any model's, and run under the runtime with
the full-recompute plan (every decided tensor recomputed: one recompute step per forward op that
saves an output, of 1 to several ATen calls). On its hook-only steps the runtime's recompute method
and its hooks are wrapped in thread-CPU-time stamps (other load and intra-op threads add nothing):

- per recompute step j, its time minus the in-context time of the op it recomputes (what a
  prediction already counts for it), medians over the repeats; least squares of that excess over
  a + b * (ATen calls the step replays), a and b kept >= 0: `replay_per_step_s`, `replay_per_call_s`;
- per saved-tensor event (pack or unpack), the time inside the hooks less the recomputes they ran,
  less the same stamps around a pass-through hook (the profile's plain steps run with pass-through
  hooks, so that much is already in the op times), over the events: `hook_per_event_s`;
- per copy of a swap, beyond the copy itself (which the link measurement times) and the hook events:
  the same blocks under a plan that swaps every saved tensor against one that keeps them all
  (`_per_copy_s`): `per_copy_s`;
- what an idle plan's step (keeps every tensor, moves none: no hook) does not share with the
  profile's plain step (`_idle_costs`): steps of the blocks with no hook, with the profile's
  pass-through hook (`slackswap.runtime.op_times.as_captured`) and under the keep plan, in rotating
  order, medians of the differences within a round: `profile_hook_per_event_s` (pass-through less no
  hook, over the saved-tensor events: in every op time of the profile, in no idle step) and
  `idle_context_per_step_s` (keep plan less no hook: the runtime's context, its entry and exit, the
  model's input check and the step's report, once a step).

The full-recompute plan is the caller's (`slackswap.experiment.measured_prediction.measure_host_costs`
passes the full_recompute planner's): the planners are a layer above the runtime.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.profile.measured import RuntimeHostCost

BLOCKS, WIDTH, TOKENS = 4, 64, 64
#: `_idle_costs` runs this many rounds per repeat of the recomputes: its differences are tens to a few
#: hundred microseconds on steps of about 1.7 ms, where each recompute step is stamped on its own.
IDLE_ROUNDS_PER_REPEAT = 3


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
    """Thread CPU seconds spent in the runtime's recomputes (per plan step) and in its hooks."""

    recompute: dict
    in_hooks_s: float = 0.0
    recompute_in_hooks_s: float = 0.0


def _instrument(run, stamps: _Stamps) -> None:
    """Wrap `run`'s recompute method and the hooks it makes per step (instance attributes: the
    runtime looks both up on the instance)."""
    recompute, step_hooks = run._recompute, run._step_hooks
    depth = [0]

    def timed_recompute(j, reads=None):
        t0 = time.thread_time_ns()
        recompute(j, reads)
        dt = (time.thread_time_ns() - t0) / 1e9
        stamps.recompute.setdefault(j, []).append(dt)
        if depth[0]:
            stamps.recompute_in_hooks_s += dt

    def timed_hooks():
        pack, unpack, reached = step_hooks()

        def timed(hook):
            def wrapper(x):
                depth[0] += 1
                t0 = time.thread_time_ns()
                try:
                    return hook(x)
                finally:
                    stamps.in_hooks_s += (time.thread_time_ns() - t0) / 1e9
                    depth[0] -= 1
            return wrapper

        return timed(pack), timed(unpack), reached

    run._recompute = timed_recompute
    run._step_hooks = timed_hooks


def _pass_through_per_event_s(model, x, warmup: int, repeats: int) -> float:
    """Thread CPU seconds per event of the same stamps around a pass-through hook."""
    spent, events = [0.0], [0]

    def stamped(t):
        t0 = time.thread_time_ns()
        events[0] += 1
        spent[0] += (time.thread_time_ns() - t0) / 1e9
        return t

    per = []
    for i in range(warmup + repeats):
        spent[0], events[0] = 0.0, 0
        for p in model.parameters():
            p.grad = None
        with torch.autograd.graph.saved_tensors_hooks(stamped, stamped):
            _loss(model(x)).backward()
        if i >= warmup:
            per.append(spent[0] / max(1, events[0]))
    return statistics.median(per)


def measure_runtime_host_cost(full_recompute: Callable[[Graph, Hardware], Plan], warmup: int = 3,
                              repeats: int = 15) -> RuntimeHostCost:
    """`RuntimeHostCost` of this machine's CPU (module docstring). `full_recompute`: the full_recompute
    planner's plan of a graph (given by the caller: planners are a layer above the runtime). The RNG
    state is left as it was."""
    from slackswap.hardware import load_preset
    from slackswap.profile.measured import retime
    from slackswap.runtime import apply, capture_graph
    from slackswap.runtime.op_numbering import call_number
    from slackswap.runtime.op_times import measure_op_times

    clock = "process" if torch.get_num_threads() == 1 else "wall"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Blocks()
        x = torch.randn(TOKENS, WIDTH)
        hardware = load_preset("h200_sxm_pcie5")  # only the capture's roofline, replaced below
        graph = capture_graph(model, (x,), _loss, hardware, "runtime host cost")
        table = measure_op_times(graph, model, (x,), _loss, warmup, repeats, clock)
        timed, _ = retime(graph, table)
        plan = full_recompute(timed, hardware)
        run = apply(plan, timed, model)
        stamps = _Stamps({})
        _instrument(run, stamps)
        events, hooks = 0, []
        for i in range(1 + warmup + repeats):  # the first step is the verified one
            for p in model.parameters():
                p.grad = None
            if i == 1 + warmup:
                stamps.recompute.clear()
            stamps.in_hooks_s = stamps.recompute_in_hooks_s = 0.0
            with run:
                _loss(model(x)).backward()
            if i > warmup:
                if run.report.verified:
                    raise RuntimeError("runtime host cost: the microbenchmark's steps did not run hook-only "
                                       f"({run.report.hook_only_refusal})")
                events = len(run._program.packs) + len(run._program.unpacks)
                hooks.append((stamps.in_hooks_s - stamps.recompute_in_hooks_s) / events)
        for p in model.parameters():
            p.grad = None
        pass_through = _pass_through_per_event_s(model, x, warmup, repeats)
        hook = max(0.0, statistics.median(hooks) - pass_through)
        per_copy, copies = _per_copy_s(model, x, timed, hook, warmup, repeats)
        profile_hook, idle_context = _idle_costs(model, x, timed, warmup, IDLE_ROUNDS_PER_REPEAT * repeats)
    ops = {op.name: k for k, op in enumerate(timed.ops)}
    calls, excess = [], []
    for j, times in stamps.recompute.items():
        op = plan.steps[j].op
        k = ops[op]
        width = call_number(timed.ops[k + 1].name) - call_number(op) if k + 1 < len(timed.ops) else 1
        calls.append(width)
        excess.append(statistics.median(times) - timed.ops[k].duration_s)
    per_step, per_call = _nonnegative_line(np.array(calls, float), np.array(excess, float))
    source = (f"slackswap.runtime.eager.host_cost: {BLOCKS} pre-norm MLP blocks (width {WIDTH}, {TOKENS} tokens) "
              f"under the runtime's full-recompute plan, {len(calls)} recompute steps of {min(calls)}-{max(calls)} "
              f"ATen calls, {events} saved-tensor events; the same blocks with every tensor swapped against every "
              f"tensor kept, {copies} copies; with no hook, the profile's pass-through hook and the keep plan, "
              f"{IDLE_ROUNDS_PER_REPEAT * repeats} steps each; thread CPU time, medians over {repeats} hook-only "
              f"steps; op times by the {clock} clock; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    return RuntimeHostCost(hook_per_event_s=hook, replay_per_step_s=per_step, replay_per_call_s=per_call,
                           per_copy_s=per_copy, idle_context_per_step_s=idle_context,
                           profile_hook_per_event_s=profile_hook, source=source)


def _idle_costs(model, x, graph, warmup: int, repeats: int) -> tuple[float, float]:
    """(`profile_hook_per_event_s`, `idle_context_per_step_s`: module docstring) in thread CPU seconds:
    steps with no hook, with the profile's pass-through hook and under a plan that keeps every tensor
    (idle), in rotating order (no kind always after the same one); medians of the differences within a
    round, each kept >= 0."""
    from slackswap.plan import Decision
    from slackswap.runtime import apply
    from slackswap.runtime.op_times import as_captured
    from slackswap.testing import schedule_from_decisions

    keep = apply(schedule_from_decisions(graph, {t.name: Decision.KEEP for t in graph.saved_tensors}), graph, model)
    contexts = {"bare": contextlib.nullcontext, "pass": as_captured, "keep": lambda: keep}
    kinds = tuple(contexts)
    events = int(graph.meta["saved_tensor_packs"]) + int(graph.meta["saved_tensor_unpacks"])

    def step(kind: str) -> float:
        for p in model.parameters():
            p.grad = None
        c0 = time.thread_time_ns()
        with contexts[kind]():
            _loss(model(x)).backward()
        return (time.thread_time_ns() - c0) / 1e9

    rounds = []
    for i in range(1 + warmup + repeats):  # the keep plan's first step is the verified one
        t = {kind: step(kind) for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]}
        if i > warmup:
            rounds.append(t)
    if keep.report.verified:
        raise RuntimeError("runtime host cost: the keep plan's steps did not run hook-only")

    def median(a: str, b: str) -> float:
        return statistics.median(t[a] - t[b] for t in rounds)

    return max(0.0, median("pass", "bare") / max(1, events)), max(0.0, median("keep", "bare"))


def _per_copy_s(model, x, graph, hook_per_event_s: float, warmup: int, repeats: int) -> tuple[float, int]:
    """(thread CPU seconds per copy beyond the copy itself and the hook events, copies per step): steps
    under a plan that swaps every decided tensor against steps under one that keeps them all (idle: no
    hook), alternating; less the hook events the swap plan's step makes (`hook_per_event_s` each) and
    the copies themselves (`copy_` into a host buffer and a `clone` back, what the link measurement
    times, `slackswap.profile.torch.links`), timed here on buffers of the same sizes."""
    from slackswap.plan import Decision
    from slackswap.runtime import apply
    from slackswap.testing import schedule_from_decisions

    decided = [t.name for t in graph.saved_tensors]
    swap = schedule_from_decisions(graph, {n: Decision.SWAP for n in decided})
    keep = schedule_from_decisions(graph, {n: Decision.KEEP for n in decided})
    sizes = graph.size_bytes_of
    copies = [sizes[t.tensor] for t in swap.offloads] + [sizes[t.tensor] for t in swap.prefetches]
    events = int(graph.meta["saved_tensor_packs"]) + int(graph.meta["saved_tensor_unpacks"])
    runs = {"swap": apply(swap, graph, model), "keep": apply(keep, graph, model)}
    buffers = [(torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8))
               for n in copies[:len(swap.offloads)]]

    def step(kind: str) -> float:
        for p in model.parameters():
            p.grad = None
        c0 = time.thread_time_ns()
        if kind == "copies":  # the offloads and their reloads alone
            for src, host in buffers:
                host.copy_(src)
                host.clone()
        else:
            with runs[kind]:
                _loss(model(x)).backward()
        return (time.thread_time_ns() - c0) / 1e9

    extra = []
    for i in range(1 + warmup + repeats):  # the first step of each run is the verified one
        t = {kind: step(kind) for kind in ("swap", "keep", "copies")}
        if i > warmup:
            extra.append(t["swap"] - t["keep"] - t["copies"] - events * hook_per_event_s)
    return max(0.0, statistics.median(extra) / max(1, len(copies))), len(copies)


def _nonnegative_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum (a + b x - y)^2: the unconstrained fit, else the best one-term fit."""
    if len(set(x.tolist())) > 1:
        (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), y, rcond=None)
        if a >= 0 and b >= 0:
            return float(a), float(b)
    only_a = max(0.0, float(y.mean()))
    only_b = max(0.0, float((x @ y) / (x @ x)))
    if ((only_a - y) ** 2).sum() <= ((only_b * x - y) ** 2).sum():
        return only_a, 0.0
    return 0.0, only_b


__all__ = ["measure_runtime_host_cost"]
