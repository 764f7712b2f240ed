"""What one eager step did (`RunReport`), and the plan's counts it is compared with."""

from __future__ import annotations

from dataclasses import dataclass, field

from slackswap.plan import Plan, StepKind


class _NoLedger:
    """Hook-only steps measure no ledger (it needs a dispatch mode after every op)."""

    peak_bytes = 0
    peak_step = -1
    live_by_step: dict[int, frozenset[int]] = {}
    device_peak_bytes = 0
    device_peak_step = -1
    device_live_by_step: dict[int, frozenset[int]] = {}

    def track(self, storage: object, copy_id: int, saved: bool = True) -> None:
        return None

    def poll(self, step: int) -> None:
        return None



@dataclass
class RunReport:
    """What one step under the runtime did; `equals_plan` compares the counts with the plan's."""

    ledger_peak_bytes: int = 0
    #: Plan step during which the ledger peaked (-1: outside any step).
    ledger_peak_step: int = -1
    #: Peak of every device storage of a graph tensor (not only saved ones): the simulator's
    #: `peak_activation_bytes` on the same link; and the plan step where it was reached.
    device_peak_bytes: int = 0
    device_peak_step: int = -1
    #: Peak of the weight gradients' storages the step made (model state, not in `device_peak_bytes`):
    #: the graph's `WEIGHT_GRADS_KEY` bytes, all alive at the step's end.
    weight_grad_peak_bytes: int = 0
    #: Per plan step, the copies of every graph tensor alive in it; when traced.
    device_live_by_step: dict[int, frozenset[int]] = field(default_factory=dict)
    #: Per plan step, the copies (ids into the plan's resolved schedule) alive in it; when traced.
    live_by_step: dict[int, frozenset[int]] = field(default_factory=dict)
    aten_calls: int = 0
    recompute_steps: int = 0
    recompute_aten_calls: int = 0
    offloads: int = 0
    prefetches: int = 0
    #: Host bytes the runtime held after the offloads issued before each plan step (index n: after the
    #: last step) where it issued transfers, and their peak: `PlanPositions.host_live_bytes` and
    #: `host_peak_bytes` as measured (verified steps; 0 and empty on hook-only steps).
    host_live_bytes: dict[int, int] = field(default_factory=dict)
    host_peak_bytes: int = 0
    #: Unpacks that found their prefetch not yet arrived and made compute wait for it.
    late_prefetch_waits: int = 0
    counts_by_kind: dict[str, int] = field(default_factory=dict)
    #: True: the step ran under the dispatch modes (every call checked, ledger measured); False: a
    #: hook-only step (saved-tensor hooks only; no ledger: its figures are 0).
    verified: bool = True
    #: Why this plan's steps cannot run hook-only (None: they can, or have).
    hook_only_refusal: str | None = None
    #: Why this step ran verified rather than on hooks alone (None: it ran on hooks alone), in a line.
    verified_because: str | None = None


def plan_counts(plan: Plan) -> dict[str, int]:
    return {
        "recompute_steps": sum(1 for s in plan.steps if s.kind == StepKind.RECOMPUTE),
        "offloads": len(plan.offloads),
        "prefetches": len(plan.prefetches),
    }
