"""The paired steps of `benchmarks/measured_profile.py`: a plan's steps interleaved round by round with
keep_all's on a copy of the same model, and the paired overhead read from them.

Why: the benchmark's overhead was the plan's median step over keep_all's, each measured in its own run
of steps seconds apart; on the shared 2-core machine of record the machine's speed moves between those
runs, and one row's overhead gap moved by 10-50 percentage points between consecutive runs of the same
code (its `across_runs`). As in `benchmarks/runtime_overhead.py` (docs/decisions/0016), a ratio of two
steps timed within a round, in one machine state, reads the plan's cost where the quotient of two
medians reads when each happened to run (docs/decisions/0021).

A round is one keep_all step and one step of the plan, on the same batch, each from its own model
(identical weights: a `copy.deepcopy` made before either steps), its own AdamW and its own RNG stream
(both from the seed, as `train_steps` after `torch.manual_seed(seed)` starts one; each side's state is
set before its step and kept after it, so the plan draws the dropout masks it drew when it ran alone,
and the two sides stay bit-identical step for step: `paired_losses_equal`). Which side goes first
alternates: keep_all in even rounds, the plan in odd ones. Round 0 is each side's warm-up (the runtime's
verified step, the export's audited one) and is left out, as `compare_steps` leaves it out. A step is
timed as `slackswap.runtime.train.train_steps` times it: forward and backward on the benchmark's clock,
the optimizer step after the clock is read. Needs torch when a stepping function runs; `paired_overhead`
does not.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from benchmarks.runtime_overhead_measures import paired_ratio

#: A row's overhead gap, in percentage points, within which the overhead is met (docs/profile.md).
OVERHEAD_TARGET_PP = 3.0


def paired_overhead(plan_times_s: list[float], keep_all_times_s: list[float], predicted: float) -> dict:
    """A row's paired figures from its rounds' step times (warm-up round left out, both lists in round
    order): `overhead_measured_paired`, the median over rounds of the plan's step over keep_all's in the
    same round; its gap to `predicted` (the predicted overhead) in percentage points; whether that is
    within the 3 pp target; and keep_all's median over the same rounds."""
    import statistics

    if not plan_times_s:
        raise ValueError("no timed rounds: a paired overhead needs at least one")
    measured = paired_ratio(plan_times_s, keep_all_times_s)
    gap = 100 * (predicted - measured)
    return {"overhead_measured_paired": measured, "overhead_gap_pp_paired": gap,
            "overhead_within_3pp_paired": abs(gap) <= OVERHEAD_TARGET_PP,
            "paired_keep_all_median_s": statistics.median(keep_all_times_s)}


def paired_runtime_steps(w, graph, plan, keep_all, steps: int, lr: float, seed: int,
                         clock: Callable[[], float]) -> tuple[list, list]:
    """(the plan's step records, keep_all's) of `steps` rounds: the plan under `apply` on `w.model`,
    keep_all under `apply` on a copy of it made first."""
    from slackswap.runtime.eager import apply

    base = copy.deepcopy(w.model)
    return _rounds(w, (w.model, apply(plan, graph, w.model)), (base, apply(keep_all, graph, base)),
                   steps, lr, seed, clock)


def paired_export_steps(w, graph, plan, keep_all, steps: int, lr: float, seed: int,
                        clock: Callable[[], float]) -> tuple[list, list]:
    """(the plan's step records, keep_all's) of `steps` rounds: `w.model` with the plan's export
    installed (eager per-layer selective checkpointing, as `export_steps` runs it), keep_all under
    `apply` on a copy made before the export is installed."""
    from slackswap.runtime.eager import apply
    from slackswap.runtime.export import PlanExport

    base = copy.deepcopy(w.model)
    with PlanExport(plan, graph, w.model).installed(w.model):
        return _rounds(w, (w.model, None), (base, apply(keep_all, graph, base)), steps, lr, seed, clock)


def _rounds(w, plan_side: tuple, keep_all_side: tuple, steps: int, lr: float, seed: int, clock) -> tuple[list, list]:
    import torch

    from slackswap.runtime.train import step_batch

    device = w.batch.device
    generator = torch.Generator(device=device).manual_seed(seed)
    torch.manual_seed(seed)  # what `_seed0` did before `train_steps`, now once for both sides
    state = _rng_state(device)
    sides = [_Side(model, run, torch.optim.AdamW(model.parameters(), lr=lr), state)
             for model, run in (plan_side, keep_all_side)]
    for i in range(steps):
        batch = step_batch(w, generator)
        for side in (sides if i % 2 else sides[::-1]):  # keep_all first in even rounds, the plan in odd ones
            side.step(w, batch, i, clock)
    return sides[0].records, sides[1].records


class _Side:
    """One model of the pair: its runtime run (None: plain, the export installed on it), optimizer, RNG
    stream and records."""

    def __init__(self, model, run, optimizer, rng_state) -> None:
        self.model, self.run, self.optimizer, self.rng_state = model, run, optimizer, rng_state
        self.records: list = []

    def step(self, w, batch, i: int, clock) -> None:
        """One step as `slackswap.runtime.train.train_steps` makes it, on this side's model and RNG stream."""
        from slackswap.runtime.train import timed_step

        _set_rng_state(batch.device, self.rng_state)
        self.records.append(timed_step(w, self.model, self.run, self.optimizer, batch, i, clock))
        self.rng_state = _rng_state(batch.device)


def _rng_state(device) -> tuple:
    import torch

    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device, state: tuple) -> None:
    import torch

    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


__all__ = ["OVERHEAD_TARGET_PP", "paired_export_steps", "paired_overhead", "paired_runtime_steps"]
