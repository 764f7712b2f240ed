"""Console lines of `profile.timing=measured` runs (pipelines.train)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def load_text() -> str:
    """The machine's 1-minute load average beside its core count: measured times mean little without it."""
    return f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def host_text(f: Mapping[str, Any]) -> str:
    """The executor's own host work the prediction added (`slackswap.experiment.measured_prediction`). The
    runtime's is negative for an idle plan, whose step runs no hook where the profile's steps ran one. Where
    the op-time table timed its ops' replays, the runtime's says how many recompute steps were priced at
    them and how many by the microbenchmark (their op had none)."""
    runtime = "runtime host work"
    timed, fallback = f.get("replay_timed_steps", 0), f.get("replay_fallback_steps", 0)
    if f.get("replay_times_measured") and timed + fallback:
        runtime += (f" ({timed} recompute steps at their ops' measured replay times, {fallback} at the "
                    "microbenchmark's)")
    parts = [(f[k], what) for k, what in (("predicted_runtime_host_s", runtime),
                                          ("predicted_dispatch_s", "SAC dispatch"),
                                          ("predicted_checkpoint_s", "checkpoint host work"),
                                          ("predicted_replayed_views_s", "views the replays run again")) if f.get(k)]
    return "".join(f" {'-' if s < 0 else '+'} {abs(s) * 1e3:.2f} ms {what}" for s, what in parts)


def copy_text(f: Mapping[str, Any]) -> str:
    """Where the op-time table timed its tensors' copies: how many of the plan's copies were priced at
    them and how many by the machine description's copy curve (their tensor had none)."""
    timed, curve = f.get("copies_at_copy_times", 0), f.get("copies_by_curve", 0)
    if not f.get("copy_times_measured") or not timed + curve:
        return ""
    return f" ({timed} at their tensors' measured copy times, {curve} by the copy curve)"


def comparison_line(f: Mapping[str, Any]) -> str:
    copies = (f" + {f['predicted_sync_copy_s'] * 1e3:.2f} ms synchronous copies{copy_text(f)}"
              if f.get("machine_synchronous_copies") else "")
    return (f"[train] predicted step {f['predicted_step_s'] * 1e3:.2f} ms (simulated on the measured profile"
            f"{copies}{host_text(f)}) vs measured {f['measured_step_median_s'] * 1e3:.2f} ms median of "
            f"{f['measured_steps_compared']} steps after the first (min {f['measured_step_min_s'] * 1e3:.2f}, max "
            f"{f['measured_step_max_s'] * 1e3:.2f}): error {f['step_relative_error'] * 100:+.1f} %; {load_text()}"
            + ("; from op times that do not add up to their own step (the op-time table's line above)"
               if f.get("op_times_sum_refusal") else ""))


def drift_line(f: Mapping[str, Any]) -> str | None:
    """The plain step before and after the plan's steps (`slackswap.experiment.measured_timing.PlainDrift`),
    and the prediction at the speed their mean says the machine ran at (`PairedPrediction`)."""
    if "plain_step_after_s" not in f:
        return None
    from slackswap.experiment.measured_timing import PairedPrediction, PlainDrift

    drift = PlainDrift(f["plain_step_before_s"], f["plain_step_after_s"])
    if "predicted_plain_step_s" not in f:
        return f"[train] {drift.line()}"
    paired = PairedPrediction(f["predicted_step_s"], f["predicted_plain_step_s"], drift.mean_s,
                              f["measured_step_median_s"])
    return (f"[train] {drift.line()}\n"
            f"[train] {paired.line()}")
