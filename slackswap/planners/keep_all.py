"""Old import path, kept while parallel branches move over: import from `slackswap.schedule.build` instead."""

from slackswap.schedule.build import keep_all_plan  # noqa: F401
