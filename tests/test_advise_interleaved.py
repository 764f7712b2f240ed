"""advise searches interleaved 1F1B layouts (`advise.pipeline_schedule`, `advise.virtual_stages`): an
interleaved row is what `pipelines.run`'s pipeline planning (`slackswap.experiment.pipeline_run`)
gives for the same layout, its optimistic estimate never undercuts the planned step, and bad values
are refused naming the field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipelines.advise_report import layout_lines
from slackswap.errors import ConfigError
from slackswap.experiment.advise import SearchSpace, plan_search
from slackswap.experiment.advise_layout import LayoutSearch
from slackswap.experiment.advise_layout_configs import layout_configs
from slackswap.experiment.advise_space import LAYOUT_DOES_NOT_DIVIDE, Candidate, Layout
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from tests.advise_support import MIXED, TOPO, graphs_of, load_conf


@pytest.fixture(scope="module")
def model() -> ModelConfig:
    # tiny's shape with 8 layers (pp 2 x v 2 and pp 4 x v 2 divide them), activations of megabytes
    return replace(ModelConfig.from_dict(load_conf("model", "tiny")), num_layers=8, attention="flash",
                   hidden_size=512, ffn_hidden_size=2048, seq_len=512, num_heads=8, num_kv_heads=8)


@pytest.fixture(scope="module")
def a100() -> Hardware:
    return Hardware.from_dict(load_conf("hardware", "a100_80gb_pcie4"))


def _space(**kw) -> SearchSpace:
    base = dict(gpus=(2,), recipes={"mixed": MIXED}, micro_batches=(1, 2), planners={"keep_all": {}},
                plan_against=("allocated",), reserve_bytes=0, zero_stages=(0,), pp=(2,),
                pipeline_microbatches=(4,), pipeline_schedule=("1f1b", "interleaved"), virtual_stages=(2,))
    return SearchSpace(**{**base, **kw})


def test_the_space_takes_interleaved_and_names_bad_values():
    space = _space(pipeline_schedule="interleaved", virtual_stages=(2, 4))
    assert space.pipeline_schedule == ("interleaved",)
    assert space.pipeline_variants() == [("interleaved", 2), ("interleaved", 4)]
    assert _space().pipeline_variants() == [("1f1b", 1), ("interleaved", 2)]
    assert _space(pipeline_schedule="1f1b").pipeline_variants() == [("1f1b", 1)]
    for kw, field in (({"virtual_stages": (1, 2)}, "advise.virtual_stages"),
                      ({"virtual_stages": (4, 2)}, "advise.virtual_stages"),
                      ({"virtual_stages": ()}, "advise.virtual_stages"),
                      ({"pipeline_schedule": "zero_bubble"}, "advise.pipeline_schedule"),
                      ({"pipeline_schedule": ("1f1b", "1f1b")}, "advise.pipeline_schedule"),
                      ({"pipeline_schedule": ()}, "advise.pipeline_schedule")):
        with pytest.raises(ConfigError) as exc:
            _space(**kw)
        assert exc.value.field == field and "\n" not in str(exc.value)


def test_megatrons_interleaved_constraints_are_rejected_regions(model, a100):
    # 8 layers: pp 2 x v 3 does not divide them; 6 micro-batches are not a multiple of pp 4
    space = _space(gpus=(4,), pp=(2, 4), virtual_stages=(2, 3), pipeline_microbatches=(6, 8), layout_top_n=1)
    _, ctx = plan_search(model, a100, TOPO, space, graphs_of(model, a100))
    out = LayoutSearch()
    configs = layout_configs(ctx, 4, out, (0.0, 0.0))
    details = [r.detail for r in out.regions if r.reason == LAYOUT_DOES_NOT_DIVIDE]
    assert any(d.startswith("parallel.virtual_stages=3: times parallel.pp=2 does not divide") for d in details)
    assert any(d.startswith("parallel.microbatches=6: must be a multiple of parallel.pp=4") for d in details)
    variants = {(c.layout.pp, c.layout.microbatches, c.layout.schedule, c.layout.virtual_stages) for c in configs}
    assert (4, 8, "interleaved", 2) in variants and (2, 6, "interleaved", 2) in variants
    assert (4, 6, "1f1b", 1) in variants  # 1F1B takes any micro-batch count
    assert not any(s == "interleaved" and (p, m) == (4, 6) or v == 3 and p == 2 for p, m, s, v in variants)


def test_an_interleaved_row_is_what_pipelines_run_plans(model, a100):
    """advise's row of pp 2 x v 2 (4 micro-batches, dp 1) against `build_stages` + `plan_pipeline` of a
    RunSpec for the same layout, budget and planner: the same per-device budgets, in-flight counts,
    static memory and peaks, the same chunk times, and its step the pipeline's over those times with
    advise's optimizer tails (the run's graphs here carry no optimizer; the step model is the same)."""
    from slackswap.budget import Budget
    from slackswap.experiment.advise_layout_configs import optimizer_share_s, stage_param_counts
    from slackswap.experiment.advise_layout_eval import evaluate_layout
    from slackswap.experiment.fitting import FitOptions
    from slackswap.experiment.pipeline_run import build_stages, plan_pipeline
    from slackswap.experiment.spec import RunSpec
    from slackswap.planners.registry import get_planner
    from slackswap.simulate.pipeline import simulate_pipeline
    from slackswap.simulate.pipeline_stage import stage_times

    lay = Layout(2, 0, 1, pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)
    keep_all = evaluate_layout(plan_search(model, a100, TOPO, _space(), graphs_of(model, a100))[1],
                               Candidate(lay, "mixed", MIXED, 2, "keep_all", "reserved"))
    # A margin that leaves the fuller device 70 % of its keep-all activation peak: the planner must act.
    act = max(p.peak_bytes - p.static_bytes for p in keep_all.stages)
    margin = a100.device_memory_bytes - max(p.static_bytes for p in keep_all.stages) - int(0.7 * act)
    space = _space(planners={"slackswap": {}}, plan_against=("reserved",), margin_bytes=margin)
    _, ctx = plan_search(model, a100, TOPO, space, graphs_of(model, a100))
    row = evaluate_layout(ctx, Candidate(lay, "mixed", MIXED, 2, "slackswap", "reserved"))
    assert row.status == "ok", row.reason

    spec = RunSpec(replace(model, micro_batch_size=2, include_optimizer=False), a100,
                   Budget(device=True, reserve_bytes=margin), "slackswap", {}, MIXED,
                   FitOptions(allocator="caching", plan_against="reserved"), planner=get_planner("slackswap"),
                   parallel=lay.parallel)
    run = plan_pipeline(spec, build_stages(spec))
    assert run.pipeline is not None, run.reason
    devices = [run.stages[d::2] for d in range(2)]
    assert [p.chunks for p in row.stages] == [(0, 2), (1, 3)]
    assert [p.in_flight for p in row.stages] == [d[0].in_flight for d in devices] == [5, 3]
    assert [p.budget_bytes for p in row.stages] == [d[0].budget_bytes for d in devices]
    assert [p.static_bytes for p in row.stages] == [d[0].capacity.static.total_bytes for d in devices]
    assert [p.peak_bytes - p.static_bytes for p in row.stages] == [d[0].peak_bytes for d in devices]
    assert any(s.fitted.result.swapped_tensors or s.fitted.result.recomputed_tensors for s in run.stages)
    times = [stage_times(s.graph, s.fitted.result) for s in run.stages]
    assert [p.forward_s for p in row.stages] == pytest.approx([sum(t.forward_s for t in times[d::2]) for d in range(2)])
    assert [p.backward_s for p in row.stages] == pytest.approx(
        [sum(t.backward_s for t in times[d::2]) for d in range(2)])
    assert simulate_pipeline(times, 4, run.p2p_s, "interleaved", 2).step_s == pytest.approx(run.pipeline.step_s)
    tails = [optimizer_share_s(ctx, MIXED, n) for n, _ in stage_param_counts(ctx, 1, 2, 2)]
    with_tails = [replace(t, tail_s=tail) for t, tail in zip(times, tails, strict=True)]
    assert row.step_s == pytest.approx(simulate_pipeline(with_tails, 4, run.p2p_s, "interleaved", 2).step_s)
    # The answer names the schedule and the chunks.
    assert "interleaved v2" in lay.label and row.to_json()["virtual_stages"] == 2
    assert row.to_json()["stages"][0]["chunks"] == (0, 2)
    text = "\n".join(layout_lines(row))
    assert "schedule interleaved with 2 chunks per stage" in text and "stage 0 (chunks 0, 2)" in text


def test_the_optimistic_estimate_is_never_below_the_planned_step(model, a100):
    """Every layout configuration, 1F1B, interleaved and ZB-H1, planned, reaches at most the tokens/s its
    optimistic estimate promised (the interleaved bubble counted as (p - 1) / (v m) of the ideal, ZB-H1's
    as none), and a ZB-H1 row beats its 1F1B twin."""
    from slackswap.experiment.advise_layout_eval import evaluate_layout

    space = _space(gpus=(4,), tp=(1, 2), pp=(1, 2, 4), micro_batches=(1, 2), pipeline_microbatches=(4, 8),
                   planners={"keep_all": {}, "full_recompute": {}}, pipeline_schedule=("1f1b", "interleaved", "zb_h1"))
    _, ctx = plan_search(model, a100, TOPO, space, graphs_of(model, a100))
    configs = layout_configs(ctx, 4, LayoutSearch(), (0.0, 0.0))
    assert {(c.layout.pp, c.layout.virtual_stages) for c in configs} >= {(2, 1), (2, 2), (4, 1), (4, 2)}
    assert {c.layout.schedule for c in configs} == {"1f1b", "interleaved", "zb_h1"}
    steps = {}
    for planner in ("keep_all", "full_recompute"):
        for c in configs:
            row = evaluate_layout(ctx, Candidate(c.layout, c.recipe, c.training, c.micro_batch, planner, "allocated"))
            assert row.status == "ok", row.reason
            assert row.tokens_per_s <= c.bound_tokens_per_s, (c.layout.label, planner)
            steps[(replace(c.layout, schedule="1f1b"), c.micro_batch, planner, c.layout.schedule)] = row.step_s
    zb = {k[:3]: s for k, s in steps.items() if k[3] == "zb_h1"}
    assert zb and all(s < steps[(*k, "1f1b")] for k, s in zb.items())
