"""The one validation module: each rule says the same words everywhere, names the dotted field and the
value in one line, never takes a boolean for a number, and the config dataclasses use it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from slackswap import validation as check
from slackswap.errors import ConfigError


@pytest.mark.parametrize(
    ("rule", "kwargs", "good", "bad", "message"),
    [
        (check.positive, {}, [1, 0.5], [0, -1, math.inf, math.nan, True, "1"], "must be a positive finite number"),
        (check.non_negative, {}, [0, 0.0, 3], [-1e-9, math.inf, False, None], "must be a non-negative finite number"),
        (check.fraction, {}, [1, 0.5, 1e-9], [0, 1.01, math.nan, True], "must be in (0, 1]"),
        (check.fraction, {"zero": True, "one": False}, [0, 0.999], [1, -0.1], "must be in [0, 1)"),
        (check.fraction, {"why": "of the peak"}, [0.5], [2], "must be in (0, 1] (of the peak)"),
        (check.integer, {"minimum": 1}, [1, 7], [0, 1.0, True, "3"], "must be an integer >= 1"),
        (check.integer, {}, [-4, 0], [0.5, None], "must be an integer"),
        (check.flag, {}, [True, False], [0, "no", None], "must be true or false"),
    ],
)  # fmt: skip
def test_each_rule_returns_a_good_value_and_names_field_and_value_of_a_bad_one(rule, kwargs, good, bad, message):
    for value in good:
        assert rule("section.field", value, **kwargs) is value
    for value in bad:
        with pytest.raises(ConfigError) as info:
            rule("section.field", value, **kwargs)
        assert str(info.value) == f"section.field={value!r}: {message}"


def test_config_dataclasses_and_planner_options_speak_through_it() -> None:
    from slackswap.budget import Budget
    from slackswap.planners.registry import get_planner

    with pytest.raises(ConfigError) as info:
        Budget(fraction=0.5, reserve_bytes=-1)
    assert str(info.value) == "budget.reserve_bytes=-1: must be an integer >= 0"
    with pytest.raises(ConfigError) as info:
        Budget(fraction=1.5)
    assert str(info.value) == "budget.fraction=1.5: must be in (0, 1] (a share of the keep-all peak)"
    # The same option under the same dotted name in every planner (recompute_knapsack said `max_rounds`).
    for planner, value, minimum in (("recompute_knapsack", 0, 1), ("dtr", -1, 0)):
        with pytest.raises(ConfigError) as info:
            get_planner(planner, max_rounds=value)
        assert str(info.value) == f"planner.options.max_rounds={value}: must be an integer >= {minimum}"
    with pytest.raises(ConfigError, match=r"^planner.options.memory_waits='yes': must be true or false$"):
        get_planner("swap_only", memory_waits="yes")


def test_node_uplink_fraction_below_one_is_one_message() -> None:
    from slackswap.node import Node
    from tests.test_node import node

    dgx = node("dgx_a100")
    assert isinstance(dgx, Node)
    for value in (1, 1.5):
        with pytest.raises(ConfigError) as info:
            replace(dgx, nic_uplink_fraction=value)
        assert str(info.value) == f"node.nic_uplink_fraction={value!r}: must be in [0, 1)"
