"""The profiling steps a CPU op-time table ends with (`slackswap.runtime.eager.profiling_steps`): stamps
start after the verified step and the warm-ups; a refused or verified step stops them with its reason;
the RNG state and the gradients are left as they were. A stand-in for the plan's run, so that each way
a run can end is met."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")

from slackswap.runtime.eager.profiling_steps import run_profiling_steps  # noqa: E402


class StandInRun(contextlib.AbstractContextManager):
    """A `PlanRun` as `run_profiling_steps` reads it: entered once per step, its report read after; step
    `refuse_at` is refused (hook-only program) and step `verify_at` runs verified."""

    def __init__(self, refuse_at: int | None = None, verify_at: int | None = None):
        self.steps, self.refuse_at, self.verify_at = 0, refuse_at, verify_at
        self.report = SimpleNamespace(hook_only_refusal=None, verified=True)

    def __exit__(self, *exc):
        i = self.steps
        self.report = SimpleNamespace(hook_only_refusal="reads a tensor autograd does not save" if i == self.refuse_at
                                      else None, verified=i == 0 or i == self.verify_at)
        self.steps += 1
        return None


def _model():
    model = torch.nn.Linear(3, 2)
    return model, (torch.ones(4, 3),), lambda out: torch.nn.functional.dropout(out, 0.5).sum()


def test_stamps_start_after_the_verified_step_and_the_warm_ups_and_leave_rng_and_grads_as_they_were():
    model, inputs, loss_fn = _model()
    run, calls = StandInRun(), []
    state = torch.get_rng_state()
    assert run_profiling_steps(run, model, inputs, loss_fn, 2, 3, lambda: calls.append(run.steps)) is None
    assert run.steps == 1 + 2 + 3 and calls == [3]  # once, before the first of the 3 stamped steps
    assert torch.equal(torch.get_rng_state(), state) and all(p.grad is None for p in model.parameters())


def test_a_refused_or_verified_step_stops_the_steps_with_its_reason():
    for run, why, stopped_after in ((StandInRun(refuse_at=2), "reads a tensor autograd does not save", 3),
                                    (StandInRun(verify_at=1), "its steps ran verified", 2)):
        model, inputs, loss_fn = _model()
        state = torch.get_rng_state()
        assert run_profiling_steps(run, model, inputs, loss_fn, 2, 3, lambda: None) == why
        assert run.steps == stopped_after
        assert torch.equal(torch.get_rng_state(), state) and all(p.grad is None for p in model.parameters())


def test_replay_times_are_scaled_so_the_ops_add_up_to_the_median_steps_replays():
    from slackswap.runtime.eager.replay_times import _median_step_scale

    # Two recompute steps over five stamped steps, each op's median 1 s: the sum of the medians, 2 s, is
    # under every step's total but one (2, 3, 3, 3, 3: a slow replay of one op or the other in most steps).
    stamps = {0: [1.0, 1.0, 1.0, 2.0, 2.0], 1: [1.0, 2.0, 2.0, 1.0, 1.0]}
    assert _median_step_scale(stamps, {0: 1.0, 1: 1.0}) == 1.5
    # Steps that add up to the medians' sum are left as they are.
    assert _median_step_scale({0: [1.0, 1.0, 1.0], 1: [2.0, 2.0, 2.0]}, {0: 1.0, 1: 2.0}) == 1.0
    # A step that missed a stamp cannot be summed: no scale.
    assert _median_step_scale({0: [1.0, 2.0], 1: [1.0]}, {0: 1.5, 1: 1.0}) == 1.0
