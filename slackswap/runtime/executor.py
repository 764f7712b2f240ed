"""Moved to `slackswap.runtime.eager`: the verified step (`eager.verified`), the hook-only
steps (`eager.hook_only`) and `PlanRun` joining them (`eager.run`). This path keeps working for old
imports."""

from slackswap.runtime.eager.report import RunReport, plan_counts
from slackswap.runtime.eager.run import PlanRun, apply
from slackswap.runtime.eager.views import _read, _whole
from slackswap.runtime.errors import PlanMismatchError, RuntimeUsageError
from slackswap.runtime.identity import check_identity

__all__ = ["PlanMismatchError", "PlanRun", "RunReport", "RuntimeUsageError", "_read", "_whole", "apply",
           "check_identity", "plan_counts"]
