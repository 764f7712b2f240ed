"""The runtime's refusals, raised by both executors (the eager `PlanRun` and the export)."""

from __future__ import annotations

from slackswap.errors import SlackSwapError


class PlanMismatchError(SlackSwapError):
    """The plan's graph does not describe the step being run (model, shapes, torch build, plan edits)."""



class RuntimeUsageError(PlanMismatchError):
    """The runtime was used in a way it cannot run exactly (nesting, torch.compile): says what to do."""
