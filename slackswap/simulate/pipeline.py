"""The pipeline step: p stages running m micro-batches in 1F1B or interleaved 1F1B order, with p2p
sends between them.

Each stage is one device that runs its micro-batch ops one at a time in the schedule's order
(`slackswap.pipeline_stages.schedule_order`). Under the interleaved schedule the model is p x v
chunks and device d runs chunks d, d + p, ...: read "stage i" below as chunk s, whose neighbours
s - 1 and s + 1 sit on devices d - 1 and d + 1 (mod p), and "stage free" as its device free.
What one op costs comes from the single-stage simulator run of that stage's (chunk's) graph under
its plan (`StageTimes`, built by `slackswap.experiment.pipeline_run`); this module only places the
ops in time, so it is exact for the numbers it is given and needs no graph. The rules:

- F(i, j), the forward of micro-batch j on stage i, waits for stage i to be free and, for i > 0,
  for the activation send of F(i - 1, j) to arrive; B(i, j) waits for the gradient send of
  B(i + 1, j) (the last stage's backward follows its own forward: it holds the loss).
- A send starts when its op ends, lasts `p2p_s` (activation bytes / link rate, `slackswap.
  communication`), and runs on the link from its device to the receiving one, one send at a time in
  the order they were issued (FIFO; under 1F1B one link per boundary and direction). It does not
  occupy either stage's compute stream.
- An op's copy wait that its stage's idle time can absorb (`StageTimes.forward_hideable_s`,
  `backward_hideable_s`: the prefetch wait before the phase's first step in the single-stage run)
  overlaps with the gap before the op: the op's compute starts at max(input arrival, stage free +
  hideable wait). The copies of micro-batch j that the bubble hides are thus credited; waits inside
  the phase stay in its time.
- ZB-H1 (`slackswap.pipeline_stages.zb_h1_order`) splits each backward: B(i, j), the input gradient,
  takes `backward_s - weight_grad_s` and sends the gradient on as a backward does; W(i, j), the
  weight gradient, takes `weight_grad_s`, follows B(i, j) on its stage and sends nothing. Under the
  other schedules `weight_grad_s` is part of the backward, as it runs.
- After its last op each device runs its tail (the optimizer steps of its chunks); the step ends
  when the last device's tail ends.

The bubble fraction is the stages' idle share of the step: 1 - sum(busy) / (p x step). With equal
stages (forward f, backward b), no p2p cost and no tail, 1F1B takes (m + p - 1)(f + b) and its bubble
fraction is (p - 1) / (m + p - 1) (Narayanan et al. 2021, section 2.2.1): tests/test_pipeline_step.py.
Interleaved with v equal chunks per device (f, b each) takes (v m + p - 1)(f + b): bubble time over
ideal time (p - 1) / (v m), the paper's section 2.2.2 figure: tests/test_pipeline_interleaved.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from slackswap.errors import ConfigError
from slackswap.pipeline_stages import SCHEDULES, releasing_kind, schedule_order


@dataclass(frozen=True)
class StageTimes:
    """What one micro-batch costs on one stage, from the stage's single-stage simulation."""

    #: The forward of one micro-batch (stage input received to stage output ready), seconds.
    forward_s: float
    #: The backward of one micro-batch (output gradient received to input gradient ready), seconds.
    backward_s: float
    #: Part of `forward_s` spent waiting for copies that idle time before the op can absorb.
    forward_hideable_s: float = 0.0
    #: Part of `backward_s` spent waiting for copies (prefetches) that idle time before it can absorb.
    backward_hideable_s: float = 0.0
    #: Work after the stage's last backward: its optimizer step, seconds.
    tail_s: float = 0.0
    #: Part of `backward_s` that is the weight gradient: ZB-H1's W pass (`slackswap.pipeline_stages`).
    weight_grad_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "forward_hideable_s", "backward_hideable_s", "tail_s",
                     "weight_grad_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"stage.{name}", value, "must be a number >= 0")
        if self.forward_hideable_s > self.forward_s or self.backward_hideable_s > self.backward_s:
            raise ConfigError("stage.hideable_s", (self.forward_hideable_s, self.backward_hideable_s),
                              "a hideable wait must be part of its op's time")
        # W = B - hideable (what `stage_times` gives where the GEMMs fill the backward) adds back to B
        # only up to the sum's rounding: a few ulps over is the same time, not a W outside the backward.
        if self.backward_hideable_s + self.weight_grad_s > self.backward_s * (1 + 4 * sys.float_info.epsilon):
            raise ConfigError("stage.weight_grad_s", self.weight_grad_s,
                              "the weight gradient and the backward's hideable wait must both be part of the backward")


@dataclass(frozen=True)
class PipelineEvent:
    """One busy interval: a device's op ("F", "B", ZB-H1's "W", "tail") or a send ("send_F" activation forward from
    chunk `chunk` of device `stage` to the next chunk, on device stage + 1 (mod p), "send_B" gradient
    to the previous chunk, on device stage - 1 (mod p))."""

    stage: int
    kind: str
    microbatch: int
    start_s: float
    end_s: float
    #: The device's local model chunk (interleaved; 0 under 1F1B and for the tail).
    chunk: int = 0


@dataclass(frozen=True)
class PipelineResult:
    schedule: str
    microbatches: int
    #: Every event, ops in the order the stages ran them, then the sends, each list by start time.
    events: tuple[PipelineEvent, ...]
    #: The pipeline's step: the end of the last event.
    step_s: float
    #: Compute busy seconds per stage (its ops and tail, not the copy waits its bubbles absorbed).
    stage_busy_s: tuple[float, ...]
    #: The most micro-batches (interleaved: micro-batch chunks) each device held between a forward and
    #: its backward, counted on the run.
    in_flight: tuple[int, ...]
    #: Model chunks per device (interleaved; 1 under 1F1B).
    virtual_stages: int = 1

    @property
    def stages(self) -> int:
        return len(self.stage_busy_s)

    @property
    def bubble_fraction(self) -> float:
        """The stages' idle share of the step: 1 - sum(busy) / (stages x step)."""
        if self.step_s <= 0:
            return 0.0
        return 1.0 - sum(self.stage_busy_s) / (self.stages * self.step_s)

    def stage_events(self, stage: int) -> tuple[PipelineEvent, ...]:
        return tuple(e for e in self.events if e.stage == stage and not e.kind.startswith("send"))


def simulate_pipeline(stages: list[StageTimes] | tuple[StageTimes, ...], microbatches: int,
                      p2p_s: float = 0.0, schedule: str = "1f1b", virtual_stages: int = 1) -> PipelineResult:
    """Place every device's micro-batch ops of one pipeline step in time (the rules: module docstring).

    `stages` are the model's p x v chunks in model order (1F1B: v = 1, one per device); chunk s runs
    on device s mod p as its local chunk s // p."""
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        raise ConfigError("parallel.virtual_stages", virtual_stages, "must be an integer >= 1")
    n = len(stages)
    if n < 1:
        raise ConfigError("parallel.pp", n, "must be an integer >= 1")
    if n % virtual_stages:
        raise ConfigError("parallel.virtual_stages", virtual_stages, f"does not divide the {n} chunks given")
    p = n // virtual_stages
    if schedule not in SCHEDULES:
        raise ConfigError("parallel.pipeline_schedule", schedule, f"must be one of {list(SCHEDULES)}")
    if not isinstance(p2p_s, (int, float)) or isinstance(p2p_s, bool) or p2p_s < 0:
        raise ConfigError("p2p_s", p2p_s, "must be a number >= 0")
    orders = [schedule_order(schedule, i, p, microbatches, virtual_stages) for i in range(p)]
    release = releasing_kind(orders[0])
    split = release == "W"  # ZB-H1: B is the input gradient alone, W the weight gradient
    done: dict[tuple[str, int, int], float] = {}  # (kind, chunk, micro-batch) -> end of the op
    arrival: dict[tuple[str, int, int], float] = {}  # (kind, chunk, micro-batch) -> its input's arrival
    link_free: dict[tuple[int, int], float] = {}  # (sending device, receiving device) -> when the link is free
    free = [0.0] * p
    head = [0] * p
    ops: list[PipelineEvent] = []
    sends: list[PipelineEvent] = []
    busy = [0.0] * p
    held = [0] * p
    most = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(p):
            while head[i] < len(orders[i]):
                kind, local, j = orders[i][head[i]]
                s = local * p + i
                ready = _input_ready(kind, s, j, n, done, arrival)
                if ready is None:
                    break
                t = stages[s]
                hide, duration = ((t.forward_hideable_s, t.forward_s) if kind == "F"
                                  else (0.0, t.weight_grad_s) if kind == "W"
                                  else (t.backward_hideable_s, t.backward_s - (t.weight_grad_s if split else 0.0)))
                compute_start = max(ready, free[i] + hide)
                end = compute_start + duration - hide
                ops.append(PipelineEvent(i, kind, j, compute_start, end, local))
                busy[i] += duration - hide
                free[i] = end
                done[(kind, s, j)] = end
                held[i] += 1 if kind == "F" else -1 if kind == release else 0
                most[i] = max(most[i], held[i])
                if kind != "W":
                    _send(kind, s, j, p, n, end, p2p_s, link_free, arrival, sends)
                head[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for these schedules; a guard against an order that deadlocks
            raise ConfigError("parallel.pipeline_schedule", schedule, "deadlocks: no stage can run its next op")
    for i in range(p):
        tail = sum(stages[c * p + i].tail_s for c in range(virtual_stages))
        if tail:
            ops.append(PipelineEvent(i, "tail", -1, free[i], free[i] + tail))
            busy[i] += tail
            free[i] += tail
    ops.sort(key=lambda e: (e.stage, e.start_s))
    sends.sort(key=lambda e: (e.start_s, e.stage))
    step = max([e.end_s for e in ops] + [e.end_s for e in sends] + [0.0])
    return PipelineResult(schedule, microbatches, tuple(ops + sends), step, tuple(busy), tuple(most), virtual_stages)


def _input_ready(kind: str, s: int, j: int, n: int, done: dict, arrival: dict) -> float | None:
    """When the input of op (kind, chunk s, j) is on its device, or None while it is not yet produced."""
    if kind == "F":
        if s == 0:
            return 0.0
        return arrival.get(("F", s, j))
    if kind == "W":
        return done.get(("B", s, j))
    if ("F", s, j) not in done:
        return None
    if s == n - 1:
        return done[("F", s, j)]
    return arrival.get(("B", s, j))


def _send(kind: str, s: int, j: int, p: int, n: int, end: float, p2p_s: float, link_free: dict, arrival: dict,
          sends: list[PipelineEvent]) -> None:
    """The activation (after F) or gradient (after B) that op (kind, chunk s, j) passes on to the next
    (previous) chunk's device, FIFO on the link from its device to that one."""
    to = s + 1 if kind == "F" else s - 1
    if not 0 <= to < n:
        return
    link = (s % p, to % p)
    start = max(end, link_free.get(link, 0.0))
    link_free[link] = start + p2p_s
    arrival[(kind, to, j)] = start + p2p_s
    sends.append(PipelineEvent(s % p, f"send_{kind}", j, start, start + p2p_s, s // p))
