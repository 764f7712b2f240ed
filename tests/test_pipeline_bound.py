"""The pipeline step's lower bound (`slackswap.simulate.pipeline_bound`): a 2-stage case worked by hand,
the simulator's monotonicity it rests on, and the bound below the step of every stage times that
meet its floors, whatever their split between forward and backward (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slackswap.simulate.pipeline import StageTimes, simulate_pipeline
from slackswap.simulate.pipeline_bound import StageFloor, pipeline_bound


def test_two_stage_bound_worked_by_hand():
    # Both stages: floor forward 1, floor backward 2, milp bound 4 on forward + backward (1 s of stall or
    # recompute no plan avoids); 2 micro-batches; a send takes 0.1.
    # Floor pipeline (times 1 / 2): s0 F0 [0,1] F1 [1,2]; s1 F0 [1.1,2.1] B0 [2.1,4.1] F1 [4.1,5.1]
    #   B1 [5.1,7.1]; s0 B0 [4.2,6.2] B1 [7.2,9.2]: 9.2.
    # Chain of device 0: input at 0; 2 x 4 - 1 (its first forward may hide a wait) = 7, but also >= 2 x 4
    #   = 8 from time 0; its last op is B(0, 1): nothing drains after it: 8.
    # Chain of device 1: input at 1 + 0.1 = 1.1; 1.1 + 8 - 1 = 8.1 (>= 8); then the last gradient is sent
    #   (0.1) and stage 0's backward (2) runs: 10.2.
    floors = [StageFloor(1, 2, 4), StageFloor(1, 2, 4)]
    bound = pipeline_bound(floors, microbatches=2, p2p_s=0.1)
    assert bound.floor_step_s == pytest.approx(9.2)
    assert bound.device_s == pytest.approx((8.0, 10.2))
    assert bound.step_s == pytest.approx(10.2)
    assert bound.device_work_s == (4, 4)
    # Plans that meet the floors, split three ways: overhead in stage 1's forward, in its backward, or in a
    # forward wait its bubble may hide; stage 0's overhead in its backward. None beats the bound.
    for stage1 in (StageTimes(2, 2), StageTimes(1, 3), StageTimes(2, 2, forward_hideable_s=1)):
        step = simulate_pipeline([StageTimes(1, 3), stage1], 2, 0.1).step_s
        assert step >= bound.step_s
    # And it is tight: stage 0's overhead a backward wait, stage 1's a forward wait, each hidden where the
    # stage idles (s1 F0 [1.1,2.1], F1 waits to 5.1 -> [5.1,6.1], B1 [6.1,8.1]; s0 B1 [8.2,10.2]). A chain
    # that charged stage 1's first forward its overhead too (11.2) would be above this plan's step.
    tight = [StageTimes(1, 3, backward_hideable_s=1), StageTimes(2, 2, forward_hideable_s=1)]
    assert simulate_pipeline(tight, 2, 0.1).step_s == pytest.approx(10.2)


def test_equal_stages_at_the_floor_give_the_1f1b_formula():
    p, m, f, b = 4, 8, 1.0, 2.0
    bound = pipeline_bound([StageFloor(f, b, f + b)] * p, m)
    assert bound.step_s == pytest.approx((m + p - 1) * (f + b)) == bound.floor_step_s
    assert max(bound.device_s) == pytest.approx((m + p - 1) * (f + b))


def test_one_slow_stage_carries_its_bound_into_the_pipeline():
    # Stage 2 of 4 has 1 s of overhead per micro-batch over its floor: m - 1 of them show in the bound
    # (one micro-batch's is credited to a wait its first forward might hide).
    p, m = 4, 8
    floors = [StageFloor(1, 2, 3)] * p
    floors[2] = StageFloor(1, 2, 4)
    bound = pipeline_bound(floors, m)
    assert bound.floor_step_s == pytest.approx((m + p - 1) * 3)
    assert bound.step_s == pytest.approx(2 * 1 + (m * 4 - 1) + 2 * 2)


_times = st.floats(min_value=0.0, max_value=5.0, allow_nan=False)


@st.composite
def _layouts(draw):
    p = draw(st.integers(2, 4))
    v = draw(st.sampled_from([1, 2]))
    m = p * draw(st.integers(1, 3)) if v > 1 else draw(st.integers(1, 6))
    return p, v, m, ("interleaved" if v > 1 else draw(st.sampled_from(["1f1b", "zb_h1"]))), draw(_times)


@st.composite
def _stage(draw):
    """(a floor, stage times that meet it): overhead split at random between forward, backward and the
    waits the pipeline may hide."""
    lf, lb, over, tail = draw(_times), draw(_times), draw(_times), draw(_times)
    w = lb * draw(st.floats(0.0, 1.0))  # ZB-H1's W floor: part of the backward's
    floor = StageFloor(lf, lb, lf + lb + over, tail, w)
    parts = [draw(st.floats(0.0, 1.0)) for _ in range(4)]
    total = sum(parts) or 1.0
    fh, bh, xf, xb = (over * x / total for x in parts) if sum(parts) else (0.0, 0.0, over, 0.0)
    extra = draw(st.just(0.0) | _times)  # a plan may be slower still
    times = StageTimes(lf + fh + xf + extra, lb + bh + xb, fh, bh, tail + draw(st.just(0.0) | _times),
                       min(w + xb * draw(st.floats(0.0, 1.0)), lb + xb))  # W and B each at or above their floor
    return floor, times


@settings(max_examples=150, deadline=None)
@given(_layouts(), st.data())
def test_the_bound_is_below_every_step_that_meets_the_floors(layout, data):
    p, v, m, schedule, p2p = layout
    stages = [data.draw(_stage()) for _ in range(p * v)]
    bound = pipeline_bound([f for f, _ in stages], m, p2p, schedule, v)
    step = simulate_pipeline([t for _, t in stages], m, p2p, schedule, v).step_s
    assert bound.step_s <= step * (1 + 1e-9) + 1e-12


@settings(max_examples=150, deadline=None)
@given(_layouts(), st.data())
def test_the_pipeline_step_is_monotone_in_stage_times(layout, data):
    """Longer ops (d and d - h both no shorter) never shorten the step: what the floor pipeline rests on."""
    p, v, m, schedule, p2p = layout
    low, high = [], []
    for _ in range(p * v):
        f, b, tail = data.draw(_times), data.draw(_times), data.draw(_times)
        fh, bh = data.draw(st.floats(0.0, 1.0)) * f, data.draw(st.floats(0.0, 1.0)) * b
        w = (b - bh) * data.draw(st.floats(0.0, 1.0))
        low.append(StageTimes(f - fh, b - bh, 0.0, 0.0, tail, w))
        df, db, dh, dt = (data.draw(_times) for _ in range(4))
        dw = db * data.draw(st.floats(0.0, 1.0))  # W and B - W both no shorter
        high.append(StageTimes(f + df, b + db, fh + min(dh, df), bh, tail + dt, min(w + dw, b + db - bh)))
    slow = simulate_pipeline(high, m, p2p + data.draw(_times), schedule, v).step_s
    fast = simulate_pipeline(low, m, p2p, schedule, v).step_s
    assert fast <= slow * (1 + 1e-9) + 1e-12
