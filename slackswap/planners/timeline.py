"""Old import path, kept while parallel branches move over: import from `slackswap.schedule.replay` instead."""

from slackswap.schedule.replay import PlanTimeline, estimate_plan  # noqa: F401
