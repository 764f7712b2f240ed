"""Old import path, kept while parallel branches move over: import from `slackswap.schedule.build` instead."""

from slackswap.schedule.build import PREFETCH_POLICIES, build_schedule, check_decisions, keep_all_plan  # noqa: F401
