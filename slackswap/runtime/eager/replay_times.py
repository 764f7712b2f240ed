"""What the eager runtime's replay of each op of the user's own graph costs on the CPU, measured once
when the op-time table is (`slackswap.runtime.op_times.measure_op_times`, `replay_plan`).

Why: a recompute step of a hook-only step (`slackswap.runtime.eager.hook_only`) replays its op's
recorded ATen calls from Python (`PlanRun._recompute`: RNG fork, argument resolution over the recorded
call's pytree, one call through its `OpOverload` per call), in backward, on data the forward left
colder. The simulator counts the op's in-context forward time for it (`slackswap.runtime.op_times`);
the rest used to be priced by a fixed microbenchmark on small MLP blocks that stay in cache
(`slackswap.runtime.eager.host_cost`: a + b x calls per step), which on the benchmark's models
priced a recompute step tens of microseconds under what it cost. So the model's own replays are
timed: profiling steps of the model under the runtime with a plan that recomputes every op it can
(the caller's: the planners are a layer above the runtime), each recompute step stamped on the
table's clock, and per op the median over the profiling steps kept (`OpTimeTable.replay_times`).

A profile measurement like the op times: each op timed in its forward (the plain steps) and in its
replay (these steps), never a step of the plan a prediction is for. Where the plan's hook-only
program refuses the model (its steps would run verified, under dispatch modes), nothing is timed and
every recompute step falls back to the microbenchmark, counted (`replay_source` says why).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from slackswap.graph import Graph
from slackswap.plan import Plan, StepKind


def measure_replay_times(graph: Graph, plan: Plan, model: torch.nn.Module, inputs: Sequence[object],
                         loss_fn: Callable[[object], torch.Tensor], now_ns: Callable[[], int], warmup: int = 2,
                         repeats: int = 5) -> tuple[dict[str, float], str]:
    """(per op `plan` recomputes: the median seconds of its replay on `now_ns` over the profiling steps;
    one line saying what was measured). One verified step, `warmup` hook-only steps, then `repeats`
    stamped ones; the RNG state is left as it was and the gradients cleared, as the op times leave them."""
    from slackswap.runtime.eager.profiling_steps import run_profiling_steps
    from slackswap.runtime.eager.run import apply

    recomputes = sum(s.kind == StepKind.RECOMPUTE for s in plan.steps)
    if not recomputes:
        return {}, f"replay times: plan {plan.planner!r} recomputes no op on this graph: none measured"
    run = apply(plan, graph, model)
    stamps: dict[int, list[float]] = {}
    recompute = run._recompute

    def stamped(j, reads=None):
        t0 = now_ns()
        recompute(j, reads)
        stamps.setdefault(j, []).append((now_ns() - t0) / 1e9)

    run._recompute = stamped  # an instance attribute: the hook-only step looks it up on the instance
    refusal = run_profiling_steps(run, model, inputs, loss_fn, warmup, repeats, stamps.clear)
    if refusal is not None:
        return {}, (f"replay times: the runtime's hook-only program refuses plan {plan.planner!r} ({refusal}): "
                    "none measured")
    per_op: dict[str, list[float]] = {}
    for j, times in stamps.items():
        per_op.setdefault(plan.steps[j].op, []).extend(times)
    medians = {op: statistics.median(times) for op, times in per_op.items()}
    scale = _median_step_scale(stamps, {j: medians[plan.steps[j].op] for j in stamps})
    scaled = {op: t * scale for op, t in medians.items()}
    return scaled, (f"replay times: {len(scaled)} ops of plan {plan.planner!r} ({recomputes} recompute steps), "
                    f"each replay stamped in {repeats} hook-only steps after {warmup} warm-up steps, medians "
                    f"scaled by {scale:.3f} to the median step's replay total")


def _median_step_scale(stamps: dict[int, list[float]], medians: dict[int, float]) -> float:
    """The median over the stamped steps of their replays' total, over the sum of the per-step medians
    (`medians`: each recompute step's op's median). Why: a prediction adds its recompute steps' replay
    times and is held against the median of measured steps, and the median of a sum is not the sum of
    the medians: an op's time is skewed right (most replays near the median, a few slower), and a step
    holds a few slow replays of one op or another where each op's median holds none; on the
    measured-profile benchmark's models the ratio read 0.996 to 1.113, median 1.023, over 36 tables
    (docs/profile.md). Scaling each op by this ratio keeps the ops' shares and makes the profile's
    median step add up. 1.0 when a step missed a stamp (not reached on a hook-only step)."""
    repeats = {len(times) for times in stamps.values()}
    total = sum(medians.values())
    if len(repeats) != 1 or total <= 0:
        return 1.0
    steps = [sum(times[r] for times in stamps.values()) for r in range(repeats.pop())]
    return statistics.median(steps) / total


__all__ = ["measure_replay_times"]
