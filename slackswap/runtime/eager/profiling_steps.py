"""The profiling steps a CPU op-time table ends with (`slackswap.runtime.eager.replay_times`,
`slackswap.runtime.eager.copy_times`): one step of the model under a plan's run, verified, then `warmup`
hook-only steps, then `repeats` steps whose stamps the caller keeps. One loop for both, so that what
is timed differs and how the steps run does not."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def run_profiling_steps(run, model: torch.nn.Module, inputs: Sequence[object],
                        loss_fn: Callable[[object], torch.Tensor], warmup: int, repeats: int,
                        before_stamped: Callable[[], None]) -> str | None:
    """Step `model` under `run` (a `slackswap.runtime.eager.run.PlanRun`) 1 + `warmup` + `repeats`
    times, calling `before_stamped` once before the first of the last `repeats` (the caller clears its
    stamps there). None when every step after the first ran hook-only; else why not, one line (the
    hook-only program's refusal, or "its steps ran verified"), the steps stopped there. The RNG state is
    left as it was and the gradients cleared."""
    try:
        with torch.random.fork_rng(devices=[]):
            for i in range(1 + warmup + repeats):  # the first step is the verified one
                for p in model.parameters():
                    p.grad = None
                if i == 1 + warmup:
                    before_stamped()
                with run:
                    loss_fn(model(*inputs)).backward()
                refusal = run.report.hook_only_refusal
                if refusal is not None or (i > 0 and run.report.verified):
                    return refusal or "its steps ran verified"
        return None
    finally:
        for p in model.parameters():
            p.grad = None


__all__ = ["run_profiling_steps"]
