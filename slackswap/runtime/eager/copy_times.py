"""What the eager runtime's inline CPU copies of each saved tensor cost inside the model's own step,
measured once when the op-time table is (`slackswap.runtime.op_times.measure_op_times`, `copy_plan`).

Why: on the CPU a swap's copies run synchronously on the compute thread, so a prediction adds their
time to the step. The machine description prices a copy from its size alone (`Machine.copy_s`: copies
timed over and over on the same two buffers, which stay in the caches); in a step a host buffer was
last written a step before and a fetched tensor in forward, and the runtime's copies there cost
0.8-3.1x that price on the measured-profile benchmark's models, the curve itself moving most between runs
(`benchmarks/copies_in_step.py`), and 0.88-1.12x the copy times measured here. So each
tensor's copies are timed where they happen: profiling steps of the model under the runtime with a
plan that offloads and fetches back every saved tensor it can (the caller's: the planners are a layer
above the runtime), each offload and prefetch stamped on the table's clock, and per tensor the median
of each direction over the profiling steps kept (`OpTimeTable.copy_times`).

A profile measurement like the op times and the replays, never a step of the plan a prediction is
for. Where the plan's hook-only program refuses the model (its steps would run verified, under
dispatch modes), nothing is timed and every copy falls back to the machine description, counted
(`copy_source` says why).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from slackswap.graph import Graph
from slackswap.plan import Plan
from slackswap.runtime.copy_engines import CpuCopies


class StampedCopies(CpuCopies):
    """Inline CPU copies, each stamped on `now_ns` per plan offload (its index in `plan.offloads`).

    The engine's bound fast paths (`offloader`, `prefetcher`) are switched off, so every copy goes
    through `offload` and `prefetch` and is stamped there (a host buffer is the plan offload's own, so
    a prefetch finds its offload by the buffer it reads)."""

    offloader = None
    prefetcher = None

    def __init__(self, now_ns: Callable[[], int]):
        super().__init__()
        self.now_ns = now_ns
        self.d2h_s: dict[int, list[float]] = {}
        self.h2d_s: dict[int, list[float]] = {}
        self._offload_of: dict[int, int] = {}

    def offload(self, source: torch.Tensor, key: int | None = None):
        t0 = self.now_ns()
        host = super().offload(source, key)
        self.d2h_s.setdefault(key, []).append((self.now_ns() - t0) / 1e9)
        self._offload_of[id(host)] = key
        return host

    def prefetch(self, offloaded, device: torch.device):
        t0 = self.now_ns()
        target = super().prefetch(offloaded, device)
        self.h2d_s.setdefault(self._offload_of.get(id(offloaded)), []).append((self.now_ns() - t0) / 1e9)
        return target


def measure_copy_times(graph: Graph, plan: Plan, model: torch.nn.Module, inputs: Sequence[object],
                       loss_fn: Callable[[object], torch.Tensor], now_ns: Callable[[], int], warmup: int = 2,
                       repeats: int = 5) -> tuple[dict[str, tuple[float, float]], str]:
    """(per tensor `plan` offloads: the median seconds of its offload and of one of its prefetches on
    `now_ns` over the profiling steps; one line saying what was measured). One verified step, `warmup`
    hook-only steps, then `repeats` stamped ones; the RNG state is left as it was and the gradients
    cleared, as the op times leave them."""
    from slackswap.runtime.eager.profiling_steps import run_profiling_steps
    from slackswap.runtime.eager.run import apply

    if not plan.offloads:
        return {}, f"copy times: plan {plan.planner!r} offloads no tensor of this graph: none measured"
    copies = StampedCopies(now_ns)

    def clear() -> None:
        copies.d2h_s.clear()
        copies.h2d_s.clear()

    refusal = run_profiling_steps(apply(plan, graph, model, copies=copies), model, inputs, loss_fn, warmup, repeats,
                                  clear)
    if refusal is not None:
        return {}, (f"copy times: the runtime's hook-only program refuses plan {plan.planner!r} ({refusal}): "
                    "none measured")
    per_tensor = {}
    for k, transfer in enumerate(plan.offloads):
        d2h, h2d = copies.d2h_s.get(k), copies.h2d_s.get(k)
        if d2h and h2d:
            per_tensor[transfer.tensor] = (statistics.median(d2h), statistics.median(h2d))
    return per_tensor, (f"copy times: {len(per_tensor)} tensors of plan {plan.planner!r} ({len(plan.offloads)} "
                        f"offloads), each copy stamped in {repeats} hook-only steps after {warmup} warm-up steps, "
                        "medians")


__all__ = ["StampedCopies", "measure_copy_times"]
