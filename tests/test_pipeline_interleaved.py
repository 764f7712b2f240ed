"""Interleaved 1F1B (`slackswap.pipeline_stages.interleaved_order`, `slackswap.simulate.pipeline`): an
exact event log worked by hand, the paper's bubble formula, in-flight counts equal to the schedule's,
and bad input refused in one line naming the field."""

from __future__ import annotations

import pytest

from slackswap.errors import ConfigError
from slackswap.pipeline_stages import in_flight_microbatches, interleaved_order, interleaved_warmup
from slackswap.simulate.pipeline import StageTimes, simulate_pipeline


def _ops(result, device):
    return [(e.kind, e.chunk, e.microbatch, e.start_s, e.end_s) for e in result.stage_events(device)]


def test_megatron_order_for_two_devices_two_chunks_four_microbatches():
    # Megatron: warm-up (p - d - 1) * 2 + (v - 1) * p = 4 on device 0, 2 on device 1; forward k is of
    # chunk (k mod 4) // 2, micro-batch (k // 4) * 2 + k mod 2; backward k of chunk 1 - (k mod 4) // 2.
    assert interleaved_warmup(0, 2, 2, 4) == 4 and interleaved_warmup(1, 2, 2, 4) == 2
    assert interleaved_order(0, 2, 2, 4) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),  # warm-up
        ("F", 0, 2), ("B", 1, 0), ("F", 0, 3), ("B", 1, 1), ("F", 1, 2), ("B", 0, 0), ("F", 1, 3), ("B", 0, 1),
        ("B", 1, 2), ("B", 1, 3), ("B", 0, 2), ("B", 0, 3),  # cool-down
    ]
    assert interleaved_order(1, 2, 2, 4) == [
        ("F", 0, 0), ("F", 0, 1),
        ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 0, 2), ("B", 0, 0), ("F", 0, 3), ("B", 0, 1),
        ("F", 1, 2), ("B", 1, 2), ("F", 1, 3), ("B", 1, 3),
        ("B", 0, 2), ("B", 0, 3),
    ]


def test_two_devices_two_chunks_event_log_worked_by_hand():
    """p = 2, v = 2, m = 4; every chunk forward 1 s, backward 2 s; sends free.

    Chunks in model order s0 s1 s2 s3: device 0 holds s0 (local 0) and s2 (local 1), device 1 holds
    s1 and s3. F(s, j) waits for F(s - 1, j); B(s, j) for B(s + 1, j), B(s3, j) for F(s3, j).
    Device 0 runs F s0:0 s0:1 s2:0 s2:1 s0:2 | B s2:0 | F s0:3 | B s2:1 | F s2:2 | B s0:0 | F s2:3 |
                  B s0:1 | B s2:2 s2:3 s0:2 s0:3
    Device 1 runs F s1:0 s1:1 s3:0 | B s3:0 | F s3:1 | B s3:1 | F s1:2 | B s1:0 | F s1:3 | B s1:1 |
                  F s3:2 | B s3:2 | F s3:3 | B s3:3 | B s1:2 s1:3
      d0 F s0:0 [0,1]  F s0:1 [1,2]          d1 F s1:0 [1,2] (s0:0 at 1)  F s1:1 [2,3]
      d0 F s2:0 [2,3] (s1:0 at 2)  F s2:1 [3,4] (s1:1 at 3)  F s0:2 [4,5]
      d1 F s3:0 [3,4] (s2:0 at 3)  B s3:0 [4,6]  F s3:1 [6,7] (s2:1 at 4, busy to 6)  B s3:1 [7,9]
      d1 F s1:2 [9,10] (s0:2 at 5, busy to 9)
      d0 B s2:0 [6,8] (B s3:0 at 6; idle [5,6])  F s0:3 [8,9]  B s2:1 [9,11] (B s3:1 at 9)
      d0 F s2:2 [11,12] (s1:2 at 10)
      d1 B s1:0 [10,12] (B s2:0 at 8)  F s1:3 [12,13] (s0:3 at 9)  B s1:1 [13,15] (B s2:1 at 11)
      d1 F s3:2 [15,16] (s2:2 at 12)  B s3:2 [16,18]
      d0 B s0:0 [12,14] (B s1:0 at 12)  F s2:3 [14,15] (s1:3 at 13)  B s0:1 [15,17] (B s1:1 at 15)
      d0 B s2:2 [18,20] (B s3:2 at 18; idle [17,18])
      d1 F s3:3 [18,19] (s2:3 at 15)  B s3:3 [19,21]  B s1:2 [21,23] (B s2:2 at 20)
      d0 B s2:3 [21,23] (B s3:3 at 21)  B s0:2 [23,25] (B s1:2 at 23)
      d1 B s1:3 [23,25] (B s2:3 at 23)   d0 B s0:3 [25,27]
    Step 27 = (v m + p - 1)(f + b) = 9 x 3; each device busy m v (f + b) = 24; bubble time / ideal
    = 3 / 24 = (p - 1) / (v m), the paper's figure; idle share of the step 6 / 54.
    """
    r = simulate_pipeline([StageTimes(1, 2)] * 4, microbatches=4, schedule="interleaved", virtual_stages=2)
    assert _ops(r, 0) == [
        ("F", 0, 0, 0, 1), ("F", 0, 1, 1, 2), ("F", 1, 0, 2, 3), ("F", 1, 1, 3, 4), ("F", 0, 2, 4, 5),
        ("B", 1, 0, 6, 8), ("F", 0, 3, 8, 9), ("B", 1, 1, 9, 11), ("F", 1, 2, 11, 12), ("B", 0, 0, 12, 14),
        ("F", 1, 3, 14, 15), ("B", 0, 1, 15, 17), ("B", 1, 2, 18, 20), ("B", 1, 3, 21, 23), ("B", 0, 2, 23, 25),
        ("B", 0, 3, 25, 27),
    ]
    assert _ops(r, 1) == [
        ("F", 0, 0, 1, 2), ("F", 0, 1, 2, 3), ("F", 1, 0, 3, 4), ("B", 1, 0, 4, 6), ("F", 1, 1, 6, 7),
        ("B", 1, 1, 7, 9), ("F", 0, 2, 9, 10), ("B", 0, 0, 10, 12), ("F", 0, 3, 12, 13), ("B", 0, 1, 13, 15),
        ("F", 1, 2, 15, 16), ("B", 1, 2, 16, 18), ("F", 1, 3, 18, 19), ("B", 1, 3, 19, 21), ("B", 0, 2, 21, 23),
        ("B", 0, 3, 23, 25),
    ]
    assert r.step_s == 27 and r.stage_busy_s == (24, 24)
    assert r.bubble_fraction == pytest.approx(6 / 54)
    assert r.in_flight == (5, 3)  # device 0: 4 warm-up chunks + 1; device 1: 2 + 1
    # Every chunk boundary is one send: 3 boundaries x 4 micro-batches x 2 directions, device 1 -> 0 for s1 -> s2.
    sends = [e for e in r.events if e.kind.startswith("send")]
    assert len(sends) == 24
    assert [(e.stage, e.chunk, e.start_s) for e in sends if e.kind == "send_F" and e.microbatch == 0] == [
        (0, 0, 1), (1, 0, 2), (0, 1, 3)]


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (2, 3, 6), (4, 2, 8), (4, 3, 8), (3, 4, 6), (8, 2, 16),
                                           (4, 2, 4)])
def test_equal_chunks_follow_the_interleaved_formula(p, v, m):
    # Narayanan et al. 2021 section 2.2.2: bubble time / ideal time = (p - 1) / (v m), vs 1F1B's (p - 1) / m.
    f, b = 1.25, 2.5
    r = simulate_pipeline([StageTimes(f, b)] * (p * v), microbatches=m, schedule="interleaved", virtual_stages=v)
    ideal = m * v * (f + b)
    assert (r.step_s - ideal) / ideal == pytest.approx((p - 1) / (v * m))
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    flat = simulate_pipeline([StageTimes(v * f, v * b)] * p, microbatches=m)
    assert (flat.step_s - ideal) / ideal == pytest.approx((p - 1) / m)  # the same model under 1F1B


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 3, 12), (3, 2, 3), (8, 4, 16)])
def test_in_flight_counts_are_the_schedules(p, v, m):
    r = simulate_pipeline([StageTimes(1, 2)] * (p * v), microbatches=m, schedule="interleaved", virtual_stages=v)
    assert r.in_flight == tuple(in_flight_microbatches(d, p, m, "interleaved", v) for d in range(p))
    for d in range(p):
        warmup = m * v if m == p else (p - d - 1) * 2 + (v - 1) * p
        assert r.in_flight[d] == min(warmup + 1, m * v)
    assert r.in_flight[0] == max(r.in_flight)  # the first device holds the most chunks in flight


def test_tails_add_over_a_devices_chunks():
    times = [StageTimes(1, 2, tail_s=0.5), StageTimes(1, 2, tail_s=0.25), StageTimes(1, 2, tail_s=1), StageTimes(1, 2)]
    r = simulate_pipeline(times, microbatches=4, schedule="interleaved", virtual_stages=2)
    tails = [e for e in r.events if e.kind == "tail"]
    assert [(e.stage, e.start_s, e.end_s) for e in tails] == [(0, 27, 28.5), (1, 25, 25.25)]
    assert r.step_s == 28.5


def test_bad_interleaved_input_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^parallel.microbatches=6: must be a multiple of parallel.pp=4"):
        interleaved_order(0, 4, 2, 6)
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=1: must be an integer >= 2"):
        interleaved_order(0, 2, 1, 4)
    with pytest.raises(ConfigError, match=r"^parallel.pp=1: must be >= 2"):
        interleaved_order(0, 1, 2, 4)
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=2: must be 1 unless"):
        simulate_pipeline([StageTimes(1, 1)] * 4, 4, virtual_stages=2)
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=2: does not divide the 3 chunks"):
        simulate_pipeline([StageTimes(1, 1)] * 3, 4, schedule="interleaved", virtual_stages=2)


def test_parallel_config_takes_interleaved_and_refuses_bad_values_in_one_line():
    from slackswap.model_config import ModelConfig
    from slackswap.parallel import ParallelConfig

    par = ParallelConfig(pp=2, microbatches=4, pipeline_schedule="interleaved", virtual_stages=2)
    assert par.chunks == 4 and par.as_dict()["virtual_stages"] == 2
    assert "virtual_stages" not in ParallelConfig(pp=2, microbatches=4).as_dict()  # 1F1B's dict is unchanged
    with pytest.raises(ConfigError, match=r"^parallel.microbatches=6: must be a multiple of parallel.pp=4"):
        ParallelConfig(pp=4, microbatches=6, pipeline_schedule="interleaved", virtual_stages=2)
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=1: must be an integer >= 2"):
        ParallelConfig(pp=2, microbatches=4, pipeline_schedule="interleaved")
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=2: must be 1 unless"):
        ParallelConfig(pp=2, microbatches=4, virtual_stages=2)
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=0: must be an integer >= 1"):
        ParallelConfig(pp=2, microbatches=4, virtual_stages=0)
    model = ModelConfig(name="t", family="llama", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=128, seq_len=32, micro_batch_size=2, vocab_size=128, dtype="bf16",
                        dropout=False, attention="flash")
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=2: times parallel.pp=2 does not divide "
                                          r"model.num_layers=6"):
        par.check_model(model)


def test_run_one_plans_each_device_under_its_budget():
    import yaml

    from slackswap.experiment.run import Verdict, run_one
    from slackswap.experiment.spec import RunSpec
    from slackswap.hardware import preset_dir

    model = {"name": "t", "family": "llama", "num_layers": 8, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
             "ffn_hidden_size": 128, "seq_len": 32, "micro_batch_size": 2, "vocab_size": 128, "dtype": "bf16",
             "dropout": False, "attention": "flash"}
    hardware = yaml.safe_load((preset_dir() / "a100_80gb_pcie4.yaml").read_text())
    cfg = {"model": model, "hardware": hardware, "budget": {"fraction": 0.75}, "planner": {"name": "swap_only"}}
    flat = run_one(RunSpec.from_dict(cfg | {"parallel": {"pp": 2, "microbatches": 4}})).metrics
    out = run_one(RunSpec.from_dict(cfg | {"parallel": {"pp": 2, "microbatches": 4, "pipeline_schedule": "interleaved",
                                                        "virtual_stages": 2}}))
    m = out.metrics
    assert out.verdict == Verdict.OK, out.reason
    assert m["pipeline_schedule"] == "interleaved" and m["pipeline_virtual_stages"] == 2
    assert m["pipeline_in_flight_by_stage"] == "5,3"  # micro-batch chunks, as the schedule holds them
    peaks = [int(v) for v in m["pipeline_peak_bytes_by_stage"].split(",")]
    budgets = [int(v) for v in m["pipeline_budget_bytes_by_stage"].split(",")]
    assert all(p <= b for p, b in zip(peaks, budgets, strict=True)) and max(peaks) == m["peak_activation_bytes"]
    # The same layers, chunked: smaller keep-all bubble, more activations held on the first device.
    assert m["pipeline_ideal_bubble_fraction"] < flat["pipeline_ideal_bubble_fraction"]
    keep_all = [int(v) for v in m["pipeline_keep_all_peak_bytes_by_stage"].split(",")]
    assert keep_all[0] > int(flat["pipeline_keep_all_peak_bytes_by_stage"].split(",")[0])
    assert m["pipeline_static_bytes_by_stage"] == flat["pipeline_static_bytes_by_stage"]  # same parameters per device
    assert m["compute_busy_s"] == pytest.approx(flat["compute_busy_s"], rel=0.02)  # device 0: the same layers x m
    assert m["model_flops"] == pytest.approx(flat["model_flops"])
    assert m["step_s"] >= m["ideal_step_s"] > 0

