"""Old import path, kept while parallel branches move over: import from `slackswap.schedule.validate` instead."""

from slackswap.schedule.validate import Copy, ResolvedSchedule, resolve_schedule, validate_plan  # noqa: F401
