"""Plan semantics in one place: what a plan means, shared by every part that executes or times one.

- `copies`: the copy resolver: which device copy of a tensor each step reads, and when each copy
  dies (the facts every executor's free rule reads);
- `validate`: the rules a plan must satisfy, checked around the resolver (`resolve_schedule`);
- `transfer`: the one copy-time formula and the in-order copy-engine queue;
- `free_rule`: the free rule (when a copy gives its bytes back);
- `positions`: where a plan acts step by step (`PlanPositions`): the transfers after each step, the
  copies held and released, each host copy's last prefetch and the host bytes live per step;
- `build`: decisions (keep / swap / recompute per saved tensor) -> the explicit schedule, and the
  keep-all schedule;
- `replay`: the planners' fast closed-form replay of a plan (no budget).

The simulator (`slackswap.simulate`), the planners and the MILP's coefficients all take these rules
from here; none of them re-implements one. docs/simulation.md states the semantics.
"""

from slackswap.schedule.build import PREFETCH_POLICIES, build_schedule, check_decisions, keep_all_plan
from slackswap.schedule.copies import Copy, ResolvedSchedule
from slackswap.schedule.positions import PlanPositions, plan_positions
from slackswap.schedule.replay import PlanTimeline, estimate_plan
from slackswap.schedule.transfer import CopyQueue, d2h_s, h2d_s, transfer_s
from slackswap.schedule.validate import resolve_schedule, validate_plan

__all__ = [
    "PREFETCH_POLICIES",
    "Copy",
    "CopyQueue",
    "PlanPositions",
    "PlanTimeline",
    "ResolvedSchedule",
    "build_schedule",
    "check_decisions",
    "d2h_s",
    "estimate_plan",
    "h2d_s",
    "keep_all_plan",
    "plan_positions",
    "resolve_schedule",
    "transfer_s",
    "validate_plan",
]
