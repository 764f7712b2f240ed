"""ZB-H1 (Qi et al. 2024, zero bubble pipeline parallelism) in the pipeline step model: each stage's
order (slackswap.pipeline_stages.zb_h1_order), an exact event log of the 2-stage pipeline of
tests/test_pipeline_step.py with its backwards split into B and W, its in-flight counts, the device
peak walk, and the W time a stage's simulation gives."""

from __future__ import annotations

import pytest

from slackswap.errors import ConfigError
from slackswap.parallel import ParallelConfig
from slackswap.pipeline_stages import in_flight_microbatches, schedule_order, zb_h1_order
from slackswap.simulate.pipeline import PipelineEvent, StageTimes, simulate_pipeline
from slackswap.simulate.pipeline_stage import device_peak_bytes


def _ops(result, stage):
    return [(e.kind, e.microbatch, e.start_s, e.end_s) for e in result.stage_events(stage)]


def test_each_stage_puts_off_as_many_weight_gradients_as_its_index():
    """p = 4, m = 6, the paper's Figure 3 pattern: stage i runs p - i - 1 warm-up forwards, i rounds of
    F B with W put off, then F B W, then B W, then its i put-off W."""
    text = [" ".join(f"{k}{j}" for k, j in zb_h1_order(i, 4, 6)) for i in range(4)]
    assert text == ["F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5",
                    "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5",
                    "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5",
                    "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"]
    # held from F to W: p on every stage, 1F1B's stage-0 count, the peak over stages of 1F1B
    assert [in_flight_microbatches(i, 4, 6, "zb_h1") for i in range(4)] == [4, 4, 4, 4]
    assert max(in_flight_microbatches(i, 4, 6) for i in range(4)) == 4
    for m in (1, 2, 3):  # fewer micro-batches than stages: every op once, B after F, W after B
        for i in range(4):
            order = zb_h1_order(i, 4, m)
            assert sorted(order) == sorted((k, j) for k in "FBW" for j in range(m))
            assert all(order.index(("F", j)) < order.index(("B", j)) < order.index(("W", j)) for j in range(m))


def test_two_stage_zb_h1_event_log_worked_by_hand():
    # tests/test_pipeline_step.py's pipeline: stage 0 forward 1, backward 2; stage 1 forward 3, backward 4;
    # 3 micro-batches; a send takes 0.5. Now the backward's weight gradient is 1 on stage 0, 2 on stage 1:
    # B (input gradient) 1 and 2, W 1 and 2. Stage 0 runs F0 F1 B0 W0 F2 B1 W1 B2 W2, stage 1 F0 B0 F1 B1
    # W0 F2 B2 W1 W2 (one W put off).
    #   s0 F0 [0,1] (sent [1,1.5]), F1 [1,2] (sent [2,2.5]); s1 F0 [1.5,4.5], B0 [4.5,6.5] (sent [6.5,7])
    #   s1 F1 [6.5,9.5], B1 [9.5,11.5] (sent [11.5,12]), W0 [11.5,13.5]
    #   s0 B0 [7,8], W0 [8,9], F2 [9,10] (sent [10,10.5]), B1 waits for its gradient: [12,13], W1 [13,14]
    #   s1 F2: input at 10.5, stage free at 13.5 -> [13.5,16.5]; B2 [16.5,18.5] (sent [18.5,19]);
    #   W1 [18.5,20.5], W2 [20.5,22.5]; s0 B2 [19,20], W2 [20,21]. Step 22.5, 1F1B's 25.
    stages = [StageTimes(1, 2, weight_grad_s=1), StageTimes(3, 4, weight_grad_s=2)]
    r = simulate_pipeline(stages, microbatches=3, p2p_s=0.5, schedule="zb_h1")
    assert _ops(r, 0) == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 7, 8), ("W", 0, 8, 9), ("F", 2, 9, 10),
                          ("B", 1, 12, 13), ("W", 1, 13, 14), ("B", 2, 19, 20), ("W", 2, 20, 21)]
    assert _ops(r, 1) == [("F", 0, 1.5, 4.5), ("B", 0, 4.5, 6.5), ("F", 1, 6.5, 9.5), ("B", 1, 9.5, 11.5),
                          ("W", 0, 11.5, 13.5), ("F", 2, 13.5, 16.5), ("B", 2, 16.5, 18.5),
                          ("W", 1, 18.5, 20.5), ("W", 2, 20.5, 22.5)]
    sends = [e for e in r.events if e.kind.startswith("send")]
    assert sends == [
        PipelineEvent(0, "send_F", 0, 1, 1.5), PipelineEvent(0, "send_F", 1, 2, 2.5),
        PipelineEvent(1, "send_B", 0, 6.5, 7), PipelineEvent(0, "send_F", 2, 10, 10.5),
        PipelineEvent(1, "send_B", 1, 11.5, 12), PipelineEvent(1, "send_B", 2, 18.5, 19),
    ]
    assert r.step_s == 22.5 < simulate_pipeline(stages, microbatches=3, p2p_s=0.5).step_s == 25
    assert r.stage_busy_s == (9, 21)  # the same work as 1F1B
    assert r.in_flight == (2, 2)  # stage 1 holds F1 beside F0 until W0: one more than under 1F1B
    # without a weight gradient to split off, B is the whole backward and W takes no time
    plain = simulate_pipeline([StageTimes(1, 2), StageTimes(3, 4)], microbatches=3, p2p_s=0.5, schedule="zb_h1")
    assert plain.step_s == 25


@pytest.mark.parametrize(("p", "m", "f", "b", "w"), [(2, 4, 1, 2, 1), (4, 8, 1, 2, 1), (4, 8, 1.25, 2.5, 1.25),
                                                     (4, 8, 1, 2, 0.5), (8, 16, 1, 3, 1)])
def test_equal_stages_follow_the_papers_zb_h1_bubble(p, m, f, b, w):
    """Qi et al. 2024, section 3.1: ZB-H1's bubble is (p - 1)(T_F + T_B - T_W), with T_B the input
    gradient b - w and T_W = w: (p - 1)(f + b - 2 w), against 1F1B's (p - 1)(f + b)."""
    r = simulate_pipeline([StageTimes(f, b, weight_grad_s=w)] * p, microbatches=m, schedule="zb_h1")
    assert r.step_s == pytest.approx(m * (f + b) + (p - 1) * (f + b - 2 * w))
    assert r.in_flight == (min(p, m),) * p


def test_the_device_peak_holds_a_microbatch_until_its_weight_gradient():
    # stage 1 of 2, m = 3: F0 B0 F1 B1 W0 F2 B2 W1 W2; resident 10 per micro-batch, peak 25.
    order = schedule_order("zb_h1", 1, 2, 3)
    # at B1: F0 (after B0, still held) + F1 running its backward (peak) = 10 + 25
    assert device_peak_bytes(order, [10], [25]) == 35
    assert device_peak_bytes(schedule_order("1f1b", 1, 2, 3), [10], [25]) == 25


def test_bad_zero_bubble_input_is_one_config_error():
    with pytest.raises(ConfigError, match="stage.weight_grad_s"):
        StageTimes(1, 2, backward_hideable_s=1.5, weight_grad_s=1)
    # W = B - hideable, as `stage_times` gives it, sums back to B only up to rounding: still inside
    backward, hideable = 3.927445746803326, 0.7427878692393841
    assert hideable + (backward - hideable) > backward  # one ulp over
    assert StageTimes(1, backward, backward_hideable_s=hideable, weight_grad_s=backward - hideable)
    with pytest.raises(ConfigError, match="stage.weight_grad_s"):
        StageTimes(1, backward, backward_hideable_s=hideable, weight_grad_s=(backward - hideable) * (1 + 1e-9))
    with pytest.raises(ConfigError, match="parallel.virtual_stages"):
        ParallelConfig(pp=2, microbatches=2, pipeline_schedule="zb_h1", virtual_stages=2)
    assert ParallelConfig(pp=2, microbatches=3, pipeline_schedule="zb_h1").chunks == 2
