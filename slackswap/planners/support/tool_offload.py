"""What the tool-offloader baselines share (slackswap/planners/strategies/save_on_cpu.py,
trl_offload.py, hf_checkpoint_offload.py): the option check for the pin cost and the build with
prefetches where the tool fetches and notes that name its offloader (`slackswap.schedule.offloader`).

Each baseline decides what its tool offloads and names its tool's offloader in the plan's notes, so
the simulator prices the copies as that tool makes them (where the copy runs, when the tool fetches,
a pinned allocation per tensor). None searches: each does what its tool does, and the plan either fits
the budget (checked on the replayed peak) or is infeasible. `pin_s_per_tensor` (default
`PIN_S_PER_TENSOR`, 3 ms: pytorch/pytorch PR 186162) is each baseline's option, so a run can state a
warm pinned cache (0) instead.
"""

from __future__ import annotations

from slackswap.errors import ConfigError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.support.budget_check import build_within_budget
from slackswap.schedule.offloader import Offloader


def pin_option(value: object) -> float:
    """The `pin_s_per_tensor` option, checked (a bad value names the field)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ConfigError("planner.options.pin_s_per_tensor", value, "must be a non-negative number of seconds")
    return float(value)


def build_for_offloader(graph: Graph, decisions: dict[str, Decision], offloader: Offloader, *, planner: str,
                        budget_bytes: int | None, hardware: Hardware, what: str) -> Plan:
    """The plan for `decisions` with prefetches where `offloader` fetches, and its notes naming it."""
    return build_within_budget(
        graph, decisions, planner=planner, budget_bytes=budget_bytes, hardware=hardware, what=what,
        prefetch="at_unpack", unpack_lookahead_steps=offloader.fetch_lookahead_steps or 0,
        notes=offloader.notes(),
    )
