"""The planner interface: (graph, hardware, budget_bytes) -> Plan, or InfeasibleBudgetError(reason).

A planner is an object with a `name` and a `plan` method. Options (thresholds, policies) are given
to its constructor, so `get_planner(name, **options)` from a Hydra `conf/planner/<name>.yaml` and a
direct construction in a test build the same thing.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from slackswap.errors import ConfigError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan


@runtime_checkable
class Planner(Protocol):
    name: str

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        """Return an explicit schedule whose activation peak stays within `budget_bytes`.

        `budget_bytes` is an absolute device activation budget; None means no limit. A planner that
        cannot meet it raises `InfeasibleBudgetError` with a specific reason; it never returns a
        plan it knows breaks the budget.
        """
        ...


def check_budget(budget_bytes: int | None) -> None:
    """Reject a budget that is not None or a positive integer (naming the value)."""
    if budget_bytes is None:
        return
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise ConfigError("budget_bytes", budget_bytes, "must be a positive integer or None (no limit)")


def gib(n_bytes: float) -> str:
    """Human-readable bytes for error messages (GiB, or MiB / KiB for small graphs)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= scale / 10:
            return f"{n_bytes / scale:.3f} {unit}"
    return f"{n_bytes:.0f} B"
