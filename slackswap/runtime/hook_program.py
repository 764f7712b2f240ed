"""Moved to `slackswap.runtime.eager.program`: this path keeps working for old imports."""

from slackswap.runtime.eager.program import (
    OFFLOAD,
    POLL,
    PREFETCH,
    RECOMPUTE,
    RELEASE,
    HookProgram,
    PackEvent,
    UnpackEvent,
    build_hook_program,
)

__all__ = ["OFFLOAD", "POLL", "PREFETCH", "RECOMPUTE", "RELEASE", "HookProgram", "PackEvent", "UnpackEvent",
           "build_hook_program"]
