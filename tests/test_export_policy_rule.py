"""The export's decision rule (`slackswap.runtime.export.policy.policy_for`) as a pure function: the
policy of an ATen call from its outputs' plan decisions and three facts about the call, table-driven."""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

CheckpointPolicy = require_torch_extra("torch.utils.checkpoint").CheckpointPolicy
policy_for = require_torch_extra("slackswap.runtime.export.policy").policy_for

from slackswap.plan import Decision  # noqa: E402

K, S, R = Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE


@pytest.mark.parametrize(("decisions", "policy"), [
    ((), CheckpointPolicy.PREFER_RECOMPUTE),  # not a saved tensor of the plan: PyTorch's choice
    ((K,), CheckpointPolicy.MUST_SAVE),
    ((S,), CheckpointPolicy.MUST_CPU_OFFLOAD),
    ((R,), CheckpointPolicy.MUST_RECOMPUTE),
    ((R, S), CheckpointPolicy.MUST_CPU_OFFLOAD),  # the most conservative output decides
    ((R, K), CheckpointPolicy.MUST_SAVE),
    ((S, K, R), CheckpointPolicy.MUST_SAVE),
])
def test_the_most_conservative_output_decision_decides(decisions, policy) -> None:
    assert policy_for(decisions) == policy


@pytest.mark.parametrize("fact", ["random", "reads_old_version", "held_by_reader"])
@pytest.mark.parametrize("decisions", [(), (R,), (S,), (R, S)])
def test_a_call_that_cannot_be_replayed_or_freed_is_saved_whatever_the_plan_says(fact, decisions) -> None:
    assert policy_for(decisions, **{fact: True}) == CheckpointPolicy.MUST_SAVE


def test_the_rule_is_pure() -> None:
    """Same arguments, same answer, arguments untouched: nothing is read from or written to a step."""
    decisions = (R, S)
    answers = {policy_for(decisions) for _ in range(3)}
    assert answers == {CheckpointPolicy.MUST_CPU_OFFLOAD} and decisions == (R, S)
