"""The eager runtime: a plan run inside a real PyTorch step, one verified step under a dispatch mode
(`verified`), then hook-only steps on the saved-tensor hooks alone (`hook_only`) driven by the program
built from the verified step's recording (`program`); `run.PlanRun` joins them (docs/runtime.md).
It stands on the runtime's base (copy engines, identities, recording, ledger, errors) and never on
the export (`slackswap.runtime.export`): tests/test_layering.py holds them apart."""

from slackswap.runtime.eager.report import RunReport, plan_counts
from slackswap.runtime.eager.run import PlanRun, apply
from slackswap.runtime.errors import PlanMismatchError, RuntimeUsageError

__all__ = ["PlanMismatchError", "PlanRun", "RunReport", "RuntimeUsageError", "apply", "plan_counts"]
