"""`benchmarks/measured_profile.py`'s paired overhead (`benchmarks.measured_pairs.paired_overhead`): a plan's
step over keep_all's in the same round, whose median reads the plan's cost where the quotient of two
medians taken at different moments reads the machine's drift between them."""
from __future__ import annotations

import pytest

from benchmarks.measured_pairs import paired_overhead


def test_a_plan_costing_a_fixed_fraction_more_reads_that_fraction_however_the_machine_drifts() -> None:
    speed = [1.0, 1.5, 0.8, 1.2, 0.9]  # the machine's seconds per unit of work, round by round
    keep_all = [4e-3 * s for s in speed]
    plan = [5e-3 * s for s in speed]
    row = paired_overhead(plan, keep_all, predicted=1.24)
    assert row["overhead_measured_paired"] == pytest.approx(1.25)
    assert row["overhead_gap_pp_paired"] == pytest.approx(-1.0)
    assert row["overhead_within_3pp_paired"] is True
    assert row["paired_keep_all_median_s"] == pytest.approx(4e-3)
    # keep_all timed alone a moment later on a machine 30 % slower: the quotient of medians reads 0.96.
    later = [t * 1.3 for t in keep_all]
    assert (sorted(plan)[2] / sorted(later)[2]) == pytest.approx(1.25 / 1.3)


def test_a_gap_past_3_pp_is_a_miss_whichever_side_it_falls() -> None:
    keep_all = [1.0, 1.0, 1.0]
    assert paired_overhead([1.1, 1.2, 1.3], keep_all, 1.24)["overhead_within_3pp_paired"] is False  # +4 pp
    low = paired_overhead([1.3, 1.2, 1.25], keep_all, 1.2)
    assert low["overhead_gap_pp_paired"] == pytest.approx(-5.0) and low["overhead_within_3pp_paired"] is False


def test_rounds_pair_one_to_one_and_there_must_be_one() -> None:
    with pytest.raises(ValueError):
        paired_overhead([1.0, 2.0], [1.0], 1.0)
    with pytest.raises(ValueError):
        paired_overhead([], [], 1.0)
