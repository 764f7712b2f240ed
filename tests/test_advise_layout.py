"""The layout half of the advise search (slackswap.experiment.advise_layout): tp / pp / cp that do not
divide the model are rejected regions, a layout whose static memory cannot fit is pruned, pipeline
rows carry every stage's plan, every answer leaves the margin, and a winner that changes the numerics
is shown with the best numerics-keeping configuration beside it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipelines.advise_report import layout_lines, numerics_lines
from slackswap.errors import ConfigError
from slackswap.experiment.advise import STATIC_DOES_NOT_FIT, SearchSpace, plan_search, run_search
from slackswap.experiment.advise_layout import search_layouts
from slackswap.experiment.advise_space import LAYOUT_DOES_NOT_DIVIDE, NOT_PLANNED, numerics_change
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ModelConfig
from tests.advise_support import MIXED, TOPO, graphs_of, load_conf

PURE16 = TrainingConfig(precision="pure16")


@pytest.fixture(scope="module")
def model() -> ModelConfig:
    # tiny's shape with 4 layers (pp 2 and 4 divide them) and flash attention (cp needs it)
    return replace(ModelConfig.from_dict(load_conf("model", "tiny")), num_layers=4, attention="flash")


@pytest.fixture(scope="module")
def a100() -> Hardware:
    return Hardware.from_dict(load_conf("hardware", "a100_80gb_pcie4"))


def _space(**kw) -> SearchSpace:
    base = dict(gpus=(4,), recipes={"mixed": MIXED}, micro_batches=(1, 2), planners={"keep_all": {}},
                plan_against=("allocated",), reserve_bytes=0, zero_stages=(0, 1), pipeline_microbatches=(4,))
    return SearchSpace(**{**base, **kw})


def _layout_rows(advice):
    return [r for r in advice.rows if not r.candidate.layout.is_data_parallel]


def test_tp_must_divide_the_heads_and_pp_the_layers(model, a100):
    advice = run_search(model, a100, TOPO, _space(gpus=(3,), tp=(1, 3), pp=(1, 3)), graphs_of(model, a100))
    divide = {r.detail.split("=")[0] for r in advice.regions if r.reason == LAYOUT_DOES_NOT_DIVIDE}
    assert divide == {"parallel.tp", "parallel.pp"}
    assert not _layout_rows(advice)  # neither tp 3 (4 heads) nor pp 3 (4 layers) is planned


def test_a_layout_whose_static_memory_cannot_fit_is_pruned_before_planning(model, a100):
    # a margin that leaves 1 KiB of the device: nothing's static memory fits
    space = _space(tp=(1, 2), pp=(1, 2), margin_bytes=a100.device_memory_bytes - 1024)
    advice = run_search(model, a100, TOPO, space, graphs_of(model, a100))
    static = [r for r in advice.regions if r.reason == STATIC_DOES_NOT_FIT]
    assert any("tp2" in r.choices["layout"] for r in static)
    assert not advice.rows and advice.best == {}


def test_a_pipeline_row_plans_every_stage_and_prices_its_step(model, a100):
    space = _space(tp=(2,), pp=(2,), micro_batches=(1,), zero_stages=(0,), layout_top_n=5)
    _, ctx = plan_search(model, a100, TOPO, space, graphs_of(model, a100))
    # no data-parallel incumbent: the layout is planned whatever its optimistic estimate
    rows = [r for r in search_layouts(ctx, []).rows if r.fits_device]
    assert rows
    r = rows[0]
    lay = r.candidate.layout
    assert (lay.dp, lay.tp, lay.pp, lay.microbatches) == (1, 2, 2, 4)
    assert [p.stage for p in r.stages] == [0, 1] and [p.in_flight for p in r.stages] == [2, 1]
    assert r.tokens_per_s > 0 and 0 < r.mfu < 1 and r.layout_comm_s > 0  # tp all-reduces priced
    assert max(p.peak_bytes for p in r.stages) == r.peak_bytes
    text = "\n".join(layout_lines(r))
    assert "dp 1, tp 2 (sp), pp 2" in text and "stage 1: planner keep_all" in text


def test_every_fitting_row_leaves_the_margin(model, a100):
    # activations of megabytes, so that micro-batches differ beyond the allocator's 2 MiB segments
    model = replace(model, hidden_size=1024, ffn_hidden_size=4096, seq_len=512, num_heads=8, num_kv_heads=8)
    unlimited = run_search(model, a100, TOPO, _space(gpus=(1,), micro_batches=(1, 2, 4)), graphs_of(model, a100))
    big = max(r.peak_bytes for r in unlimited.rows if r.fits_device)
    # the margin leaves less than the largest configuration's peak: it no longer fits, the others do
    margin = a100.device_memory_bytes - big + 1
    advice = run_search(model, a100, TOPO, _space(gpus=(1,), micro_batches=(1, 2, 4), margin_bytes=margin),
                        graphs_of(model, a100))
    fitting = [r for r in advice.rows if r.fits_device]
    assert fitting and all(r.headroom_bytes >= margin for r in fitting)
    assert all(r.peak_bytes < big for r in fitting)


def test_a_winner_that_changes_numerics_comes_with_the_best_that_does_not(model, a100):
    space = _space(gpus=(1,), recipes={"mixed": MIXED, "pure16": PURE16})
    advice = run_search(model, a100, TOPO, space, graphs_of(model, a100))
    best = advice.best_rows()[1]
    assert best.candidate.recipe == "pure16" and best.numerics == numerics_change(PURE16) != ""
    faithful = advice.rows[advice.best_faithful[1]]
    assert faithful.candidate.recipe == "mixed" and faithful.numerics == ""
    lines = numerics_lines(advice, 1)
    assert "changes the training's numerics" in lines[0] and "best keeping the numerics" in lines[1]


def test_bad_layout_lists_name_their_field():
    for field, value in (("tp", (0,)), ("pp", (2, 1)), ("pipeline_microbatches", ())):
        with pytest.raises(ConfigError) as exc:
            _space(**{field: value})
        assert exc.value.field == f"advise.{field}"


def test_zero_3_over_the_dp_group_of_a_tp_layout_holds_the_formula_bytes(model, a100):
    """tp 2 x dp 2 under ZeRO-3 (FSDP over the dp group on tp-sharded parameters): each rank holds
    ceil(P / dp) of its tp shard's P parameters times (2 params + 2 grads + 4 master + 8 Adam moments)
    bytes (ZeRO, Rajbhandari et al. 2020, section 5.1: P_os+g+p) plus two gathered units of 16-bit
    parameters; with a pipeline only stages 0 and 1 are searched (Megatron's distributed optimizer)."""
    import math

    from slackswap.parallel import ParallelConfig
    from slackswap.profile.stages import stage_parameter_counts

    space = _space(tp=(2,), micro_batches=(1,), zero_stages=(0, 1, 2, 3), layout_top_n=20)
    _, ctx = plan_search(model, a100, TOPO, space, graphs_of(model, a100))
    rows = search_layouts(ctx, []).rows
    by_stage = {r.candidate.layout.zero_stage: r for r in rows if r.candidate.layout.tp == 2
                and r.candidate.layout.pp == 1 and r.candidate.layout.cp == 1}
    assert set(by_stage) == {0, 1, 2, 3}
    params, unit = stage_parameter_counts(model, ParallelConfig(tp=2), 0)
    dp = 2
    expected = {0: params * 16, 1: params * 4 + math.ceil(params / dp) * 12,
                2: params * 2 + math.ceil(params / dp) * 14, 3: math.ceil(params / dp) * 16 + 2 * unit * 2}
    assert {z: r.static_bytes for z, r in by_stage.items()} == expected
    three = by_stage[3]
    assert three.fits_device and three.comm.forward_comm_s > 0  # the parameter all-gathers priced
    pipelined = _space(pp=(2,), micro_batches=(1,), zero_stages=(0, 1, 2, 3), layout_top_n=20)
    _, ctx = plan_search(model, a100, TOPO, pipelined, graphs_of(model, a100))
    assert {r.candidate.layout.zero_stage for r in search_layouts(ctx, []).rows
            if r.candidate.layout.pp == 2} <= {0, 1}


def test_the_layout_search_plans_the_same_rows_over_workers(model, a100):
    """The best-first search plans speculatively a batch per worker count, then replays it under the
    rising bar: two loky workers give the rows, regions and answer of one process."""
    space = _space(gpus=(4,), tp=(1, 2), pp=(1, 2), zero_stages=(0, 1, 3), micro_batches=(1, 2, 4),
                   planners={"keep_all": {}, "full_recompute": {}}, layout_top_n=6)
    # no data-parallel incumbent: the bar is what the layouts planned so far reach
    one = search_layouts(plan_search(model, a100, TOPO, space, graphs_of(model, a100))[1], [])
    two = search_layouts(plan_search(model, a100, TOPO, replace(space, n_jobs=2), graphs_of(model, a100))[1], [])
    assert one.rows and any(r.reason == NOT_PLANNED for r in one.regions)
    assert (two.rows, two.regions, two.pruned) == (one.rows, one.regions, one.pruned)


def test_cp_ranks_reduce_and_shard_the_dense_state_with_the_dp_ranks(model, a100):
    """dp 2 x cp 2 on 4 GPUs: both cp ranks of a replica hold the same dense parameters, so their
    gradients are reduced, and ZeRO shards their state, over n = dp x cp = 4 ranks (Megatron-Core's
    data-parallel group with context parallel; torchtitan's `dp_shard_cp` mesh), 1 GPU apart: NVLink
    (230 GB/s, 2 us a ring step). Hand figures: P = 4 x 49,984 (a layer: norms 2 x 128, QKV 64 x 192 +
    192, projection 64 x 64 + 64, MLP 64 x 256 + 256 + 256 x 64 + 64) + 10,368 (embeddings 128 x 64 +
    32 x 64, final norm 128) = 210,304 parameters on every rank (cp splits none); bf16 gradients and
    parameters, G = 2P = 420,608 bytes; 5 units (4 layers, embedding / head).

    - DDP: ring all-reduce of G over n = 4, 2 (n - 1) / n x G = 630,912 bytes per rank, 2 (n - 1) = 6
      ring steps per call, 5 calls: 5 x 6 x 2 us + 630,912 / 230e9 s = 62.74 us. Over dp alone
      (n = 2) it would be 420,608 bytes and 2 steps.
    - ZeRO-1: reduce-scatter of G and all-gather of the 2P-byte parameters, (n - 1) / n each: 630,912
      bytes; static 2 + 2 bytes whole + 12 bytes (fp32 master, Adam moments) over 4:
      4P + 12 ceil(P / 4) = 1,472,128 bytes (over dp alone 2,103,040).
    - ZeRO-3: 16 ceil(P / 4) + two gathered layers 2 x 2 x 49,984 = 1,041,152 bytes."""
    import math

    from slackswap.communication import all_reduce_s
    from slackswap.parallel import ParallelConfig
    from slackswap.profile.stages import stage_parameter_counts

    params, unit = stage_parameter_counts(model, ParallelConfig(dp=2, cp=2), 0)
    assert (params, unit) == (4 * 49_984 + 10_368, 49_984)
    rows = {}
    for zero in (0, 1, 3):  # one search each: best-first planning would skip a slower one
        space = _space(tp=(1,), pp=(1,), cp=(2,), micro_batches=(1,), zero_stages=(zero,), layout_top_n=20)
        _, ctx = plan_search(model, a100, TOPO, space, graphs_of(model, a100))
        rows |= {r.candidate.layout.zero_stage: r for r in search_layouts(ctx, []).rows
                 if r.candidate.layout.cp == 2 and r.status == "ok"}
    assert set(rows) == {0, 1, 3}
    n, grads = 4, 2 * params
    ddp = rows[0].comm
    assert (ddp.gpus, ddp.fabric) == (n, "nvlink")
    assert ddp.bus_bytes == pytest.approx(2 * (n - 1) / n * grads)
    assert ddp.backward_comm_s == pytest.approx(5 * 2 * (n - 1) * 2e-6 + 2 * (n - 1) / n * grads / 230e9)
    assert ddp.backward_comm_s == pytest.approx(all_reduce_s(grads, n, TOPO.intra_node, 5))
    one = rows[1]
    assert one.candidate.training.zero_shards == n and one.comm.bus_bytes == pytest.approx((n - 1) / n * 2 * grads)
    assert one.static_bytes == 4 * params + 12 * math.ceil(params / n)
    assert rows[3].static_bytes == 16 * math.ceil(params / n) + 2 * 2 * unit
