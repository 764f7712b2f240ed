"""The eager runtime's CPU host costs solved from whole steps (slackswap.runtime.eager.host_cost._solve),
on rounds worked by hand: docs/decisions/0025-runtime-host-costs-by-step.md."""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

require_torch_extra()


def test_the_runtimes_host_costs_are_solved_from_whole_steps_worked_by_hand():
    from slackswap.plan import Decision
    from slackswap.runtime.eager.host_cost import _solve
    from slackswap.testing import schedule_from_decisions
    from tests.test_measured_profile import _hooked_graph

    g = _hooked_graph()  # a: 1 pack + 2 unpacks, b: 1 + 1; 5 events
    keep, recompute, swap = Decision.KEEP, Decision.RECOMPUTE, Decision.SWAP
    plans = {"recompute": schedule_from_decisions(g, {"a": recompute, "b": keep, "gb": keep}),
             "one": schedule_from_decisions(g, {"a": keep, "b": recompute, "gb": keep}),
             "swap": schedule_from_decisions(g, {"a": swap, "b": swap, "gb": keep})}
    copies = len(plans["swap"].offloads) + len(plans["swap"].prefetches)
    context, other, recomputed, profile_hook, per_copy = 10e-6, 1e-6, 3e-6, 0.5e-6, 2e-6
    check = 4e-6  # per module call a recomputing plan's step checks: the graph's 4
    bare = 1e-3
    passed = bare + 5 * profile_hook
    rounds = [{"bare": bare, "pass": passed, "keep": bare + context,
               "recompute": passed + 100e-6 + context + 2 * other + 3 * recomputed + 4 * check,
               "recompute_replays": 100e-6,
               "one": passed + 50e-6 + context + 3 * other + 2 * recomputed + 4 * check, "one_replays": 50e-6,
               "one_unchecked": passed + 60e-6 + context + 3 * other + 2 * recomputed, "one_unchecked_replays": 60e-6,
               "copies": 40e-6, "swap": passed + context + 5 * other + 40e-6 + copies * per_copy}] * 3
    # The recompute plan's hook work is a's 3 events at the recomputed rate and b's 2 at the other, the one
    # plan's b's 2 and a's 3: two equations, each less the module checks (the one plan's step against the
    # same step unchecked, replays taken off); the swap's copies are what its step holds beyond the rest.
    solved = _solve(g, plans, rounds)
    assert solved == pytest.approx({"context": context, "profile_hook": profile_hook, "other": other,
                                    "recomputed": recomputed, "copy": per_copy, "module_check": check}, rel=1e-6)
