"""`ratio_to_eager` in `benchmarks/runtime_overhead.py` pairs each round's time with eager's of the same
round: under a machine whose speed drifts within a run it reads the cost of the variant, where the
quotient of the two leasts reads when each variant happened to run fast."""
from __future__ import annotations

import pytest

from benchmarks.runtime_overhead import paired_ratio


def test_a_variant_costing_a_fixed_fraction_more_reads_that_fraction_however_the_machine_drifts() -> None:
    speed = [1.0, 0.62, 0.9, 1.4, 0.8]  # seconds per unit of work, round by round
    eager = [10e-3 * s for s in speed]
    variant = [13e-3 * s for s in speed]
    assert paired_ratio(variant, eager) == pytest.approx(1.3)
    # The leasts of rounds timed in different machine states: eager's fast round against a slow one.
    shifted = [13e-3 * s for s in (1.0, 0.9, 0.9, 1.4, 0.8)]
    assert min(shifted) / min(eager) == pytest.approx(1.3 * 0.8 / 0.62)
    assert paired_ratio(shifted, eager) == pytest.approx(1.3)


def test_rounds_must_pair_one_to_one() -> None:
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])
