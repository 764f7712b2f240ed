"""The engine's run under a tool offloader: the compute stream waits for offloads and pays the pins.

`slackswap.schedule.offloader` says how each tool runs a plan's copies. Two of its rules change what
the compute stream does, and this run adds them to the engine's `_Run` (docs/simulation.md section 3,
"Offloaders"); everything else (copy engines, FIFO, memory, the free rule) is the engine's own:

- **offload window** k: step j starts only once every offload issued after steps before j, except
  the last k of them, has landed (k = 0: the copy runs on the compute stream, so the step after it
  waits for it; k = 5: TRL's forward stash). The time held is the step's `wait_offload_s` and the
  run's `stall_offload_s`; it is counted after the wait for a late prefetched input and before the
  wait for memory.
- **pinned allocation per tensor**: a step that issues n offloads lasts n x `pin_s_per_tensor`
  longer (the tool's pack hook pins inside the op that saves the tensor, on the host thread that
  launches the compute), and its copies start when it ends. Counted in `compute_busy_s` and reported
  apart as `pin_s`. A copy issued first could start after its own pin rather than after the last
  one: for a step that offloads several tensors this is pessimistic by up to (n - 1) pins of copy
  start, never of compute.

Prefetches are where the plan put them: a tool's "fetch at unpack" is a prefetch position
(`build_schedule(prefetch="at_unpack")`), and its reader waits for it under the engine's own rule.
The ideal offloader never comes here (`slackswap.simulate.engine._execute` runs `_Run` itself), so
every plan that names no offloader runs exactly as before. `ToolRules` is a mixin the engine puts in
front of its `_Run` (`engine._ToolRun`), so this module needs nothing of the engine's.
"""

from __future__ import annotations

from dataclasses import replace

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.schedule.copies import ResolvedSchedule
from slackswap.schedule.offloader import Offloader
from slackswap.simulate.result import SimResult


class ToolRules:
    """The engine's `_Run` with the offload window and the per-tensor pins of `offloader` (module
    docstring); a mixin, so its state lives in the slots `SLOTS` of the class that combines it."""

    __slots__ = ()
    SLOTS: tuple[str, ...] = ("offloader", "off_need", "step_pins", "off_landed", "off_landed_s",
                              "step_wait_offload", "stall_offload", "pin_total")

    def __init__(self, graph: Graph, plan: Plan, hardware: Hardware, budget_bytes: int | None,
                 s: ResolvedSchedule, offloader: Offloader):
        super().__init__(graph, plan, hardware, budget_bytes, s)
        self.offloader = offloader
        n_steps, n_off = self.n_steps, self.n_off
        issued_after = [0] * n_steps  # offloads issued after each step
        at_start = 0  # offloads issued at time zero (issue_after_step -1)
        for t in plan.offloads:
            if t.issue_after_step < 0:
                at_start += 1
            else:
                issued_after[t.issue_after_step] += 1
        window = offloader.offload_window
        self.off_need = need = [0] * n_steps  # offloads (a prefix of the list) landed before step j
        issued = at_start
        for j in range(n_steps):
            if window is not None:
                need[j] = max(0, issued - window)
            issued += issued_after[j]
        pin = offloader.pin_s_per_tensor
        self.step_pins = [pin * k for k in issued_after]
        self.off_landed = 0  # length of the prefix of offloads that has landed
        self.off_landed_s = [0.0] * (n_off + 1)  # when that prefix reached each length
        self.step_wait_offload = [0.0] * n_steps
        self.stall_offload = 0.0
        self.pin_total = 0.0

    def _offload_done(self, k: int, engine: int, now: float) -> None:
        super()._offload_done(k, engine, now)
        finished, landed = self.off_finished, self.off_landed
        while landed < self.n_off and finished[landed]:
            landed += 1
            self.off_landed_s[landed] = now
        self.off_landed = landed

    def _start_step(self, now: float) -> None:
        j = self.next_step
        need = self.off_need[j]
        if need > self.off_landed:
            return  # offloads still in flight hold it (window)
        super()._start_step(now)
        if self.next_step == j:
            return  # waiting for an input or for memory
        memory = self.step_wait_memory[j]
        if need and memory > 0.0:
            # The engine counted the time after the inputs were ready as a memory wait; the part
            # until the window opened is the offloads'.
            landed = self.off_landed_s[need]
            after = now - landed if landed < now else 0.0
            if after < memory:
                wait = memory - after
                self.step_wait_offload[j] = wait
                self.stall_offload += wait
                self.step_wait_memory[j] = after
                self.stall_memory -= wait
        pins = self.step_pins[j]
        if pins:
            self.step_end += pins
            self.step_stop[j] += pins
            self.compute_busy += pins
            self.pin_total += pins

    def result(self, plan: Plan, budget_bytes: int | None, s: ResolvedSchedule) -> SimResult:
        out = super().result(plan, budget_bytes, s)
        return replace(out, offloader=self.offloader.name, stall_offload_s=self.stall_offload, pin_s=self.pin_total)
