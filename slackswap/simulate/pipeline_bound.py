"""A certified lower bound on the pipeline step from per-stage lower bounds (docs/pipeline_parallel.md,
"The bound").

Each chunk s (1F1B: each stage) comes with a `StageFloor`: what ANY plan it may run costs at least,
per micro-batch: `forward_s` <= the plan's forward minus its hideable wait (f - fh), `backward_s`
<= b - bh, `step_s` <= f + b (the milp bound; `slackswap.experiment.pipeline_run` states why it
covers every plan the stage may run), and `tail_s` <= its tail. The bound holds for every set of
`StageTimes` that satisfies those four inequalities, whatever the split of f + b between forward and
backward, which the milp does not bound separately. Two valid bounds, the larger is reported:

1. **Floor pipeline.** `simulate_pipeline` at the floor times (forward `forward_s`, backward
   `backward_s`, no hideable wait, tail `tail_s`). The simulator is monotone: it visits the ops in
   an order that depends only on which inputs exist, never on times, so every op's end is the same
   max-plus expression of the times: end = max(ready + (d - h), free + d), send start = max(op end,
   link free), the tail adds. Each term is non-decreasing in d - h and d, and the floor has d - h = d
   = floor <= the plan's d - h <= d, so by induction over that fixed order every floor time is <= the
   plan's, and so is the step (`tests/test_pipeline_bound.py` checks it by hypothesis).
2. **Device chains.** Device d runs its ops o_1 .. o_K in its schedule order one at a time: o_1's
   compute ends at or after its input's arrival r plus d_1 - h_1, and each later op ends at or after
   the previous end plus its whole time d_k (end >= free + d whatever it waited). So its last op ends
   at or after r + sum(d_k) - h_1 and at or after sum(d_k). With m micro-batches of each of its chunks
   at f_c + b_c >= step_s(c) each, and o_1 = F(c0, j) whose (f - fh) + b >= forward_s + backward_s:
   sum(d_k) - h_1 >= m x sum_c step_s(c) - (step_s(c0) - forward_s(c0) - backward_s(c0)). r is at or
   after the forward chain of micro-batch j through chunks 0 .. c0 - 1, each at least its floor
   forward plus one send. After the device's last op, B(c1, j'), the gradient of j' still runs
   through chunks c1 - 1 .. 0, each at least a send plus its floor backward, and device 0's tail
   follows; the device's own tail follows its last op. Sends are bounded by p2p_s alone (a FIFO link
   only delays them).

ZB-H1 (the backward split into B and W, `slackswap.pipeline_stages.zb_h1_order`): the floor's W is
`weight_grad_s`, half the backward GEMMs' durations, and its B the floor backward less that. A plan's
W is half its backward GEMMs' run times (`stage_times`), each at least the op's duration, and its B
the rest of its backward, at least the other backward ops' durations: both at or above the floor's,
so the floor pipeline stays a bound. A device's chain ends with a W, which sends nothing: it is
bounded by its own ops and its tail (no drain term).
The device chains are what carry the milp's stall and recompute time into the bound: for the
slowest stage they give (its arrival) + m x its bound + (the drain), (m + p - 1)(f + b) for equal
stages, the pipeline's own figure. How loose it is: a plan's bubbles can hide part of its overhead
in ways neither bound sees, and the chain charges the overhead of only one device at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap import validation as check
from slackswap.errors import ConfigError
from slackswap.pipeline_stages import schedule_order
from slackswap.simulate.pipeline import StageTimes, simulate_pipeline


@dataclass(frozen=True)
class StageFloor:
    """What every plan of one chunk costs at least, per micro-batch (module docstring)."""

    #: <= the forward minus its hideable wait: the forward and loss ops' durations (+ exposed collectives).
    forward_s: float
    #: <= the backward minus its hideable wait: the backward ops' durations (+ exposed collectives).
    backward_s: float
    #: <= forward + backward of one micro-batch: the milp bound (+ exposed collectives).
    step_s: float
    #: <= the tail: the optimizer ops' durations.
    tail_s: float = 0.0
    #: <= ZB-H1's W and backward - weight_grad_s <= its B: half the backward GEMMs' durations.
    weight_grad_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "step_s", "tail_s", "weight_grad_s"):
            check.non_negative(f"floor.{name}", getattr(self, name))
        if self.weight_grad_s > self.backward_s:
            raise ConfigError("floor.weight_grad_s", self.weight_grad_s, "must be part of floor.backward_s")

    @property
    def overhead_s(self) -> float:
        """What the bound adds to the floor forward + backward (stalls and recompute no plan avoids)."""
        return max(0.0, self.step_s - self.forward_s - self.backward_s)

    @property
    def work_s(self) -> float:
        """The least forward + backward of one micro-batch: the larger of the bound and the floors."""
        return self.forward_s + self.backward_s + self.overhead_s


@dataclass(frozen=True)
class PipelineBound:
    """The pipeline step's lower bound and its parts."""

    #: The bound: the larger of the floor pipeline's step and every device chain.
    step_s: float
    #: `simulate_pipeline` at the floor times.
    floor_step_s: float
    #: Each device's chain bound (stage 0 first).
    device_s: tuple[float, ...]
    #: Each device's least forward + backward of one micro-batch (its chunks' `work_s` summed).
    device_work_s: tuple[float, ...]


def pipeline_bound(floors: list[StageFloor] | tuple[StageFloor, ...], microbatches: int, p2p_s: float = 0.0,
                   schedule: str = "1f1b", virtual_stages: int = 1) -> PipelineBound:
    """A lower bound on `simulate_pipeline`'s step for every chunk times that meet `floors` (module
    docstring); `floors` in model order, as `simulate_pipeline` takes its stages."""
    floor_times = [StageTimes(f.forward_s, f.backward_s, tail_s=f.tail_s, weight_grad_s=f.weight_grad_s)
                   for f in floors]
    floor = simulate_pipeline(floor_times, microbatches, p2p_s, schedule, virtual_stages)
    n, v = len(floors), virtual_stages
    p = n // v
    arrival = [0.0] * n  # the forward of any micro-batch reaches chunk s no earlier than this
    drain = [0.0] * n  # after chunk s's backward, chunks s - 1 .. 0 still take at least this
    for s in range(1, n):
        arrival[s] = arrival[s - 1] + floors[s - 1].forward_s + p2p_s
        drain[s] = drain[s - 1] + p2p_s + floors[s - 1].backward_s
    tails = [sum(floors[c * p + d].tail_s for c in range(v)) for d in range(p)]
    devices, works = [], []
    for d in range(p):
        order = schedule_order(schedule, d, p, microbatches, v)
        (first_kind, first, _), (last_kind, last, _) = order[0], order[-1]
        if first_kind != "F" or last_kind not in ("B", "W"):  # every schedule here starts with a forward
            raise ConfigError("parallel.pipeline_schedule", schedule, "a device's order must run F first, B or W last")
        s0, s1 = first * p + d, last * p + d
        work = sum(floors[c * p + d].work_s for c in range(v))
        total = microbatches * work
        end = max(arrival[s0] + total - floors[s0].overhead_s, total)
        devices.append(max(end + tails[d], end + drain[s1] + tails[0]) if last_kind == "B" else end + tails[d])
        works.append(work)
    return PipelineBound(max([floor.step_s, *devices]), floor.step_s, tuple(devices), tuple(works))


__all__ = ["PipelineBound", "StageFloor", "pipeline_bound"]
