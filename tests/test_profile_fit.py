"""The preset fit to measured op times (slackswap.profile.fit): it recovers the figures that made the
times, fits the preset on every op with a check fit reported on the ops it left out, and refuses too
few ops. Core only (no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slackswap.errors import ConfigError
from slackswap.testing import fwd, make_graph
from tests.test_measured_profile import _graph


def _roofline_graph():
    """Ops of every kind: matmuls of several sizes, 0-FLOP elementwise ops, an attention op."""
    from dataclasses import replace as dc_replace

    from slackswap.graph import OpClass

    specs, sizes, ops_meta = [], {}, []
    prev = []
    for i in range(30):
        out = f"t{i}"
        specs.append(fwd(f"f{i}", prev, [out], 1.0))
        sizes[out] = 1000
        prev = [out]
        kind = (OpClass.MATMUL, OpClass.ELEMENTWISE, OpClass.ATTENTION)[i % 3]
        flops = 0.0 if kind == OpClass.ELEMENTWISE else 1e9 * (1 + i)
        ops_meta.append((kind, flops, 10_000 * (1 + i % 7)))
    g = make_graph(specs, sizes)
    ops = tuple(dc_replace(op, op_class=k, flops=f, moved_bytes=b) for op, (k, f, b) in zip(g.ops, ops_meta,
                                                                                          strict=True))
    return type(g)(name=g.name, ops=ops, tensors=g.tensors, num_layers=g.num_layers)


def test_the_fit_recovers_the_efficiencies_that_made_the_times():
    from dataclasses import replace as dc_replace

    from slackswap.hardware import load_preset
    from slackswap.profile.fit import fit_preset, preset_yaml
    from slackswap.profile.timing import op_duration_s

    base = load_preset("h200_sxm_pcie5")
    truth = dc_replace(base, efficiency={"matmul": 0.02, "attention": 0.005, "elementwise": 1.0},
                       hbm_efficiency=0.01, launch_overhead_s=5e-6)
    g = _roofline_graph()
    measured = {op.name: op_duration_s(op.flops, op.moved_bytes, op.op_class, "bf16", truth) for op in g.ops}
    report = fit_preset(g, measured, base, "bf16", holdout_every=5, name="fitted")
    assert report.hardware.efficiency["matmul"] == pytest.approx(0.02, rel=1e-3)
    assert report.hardware.efficiency["attention"] == pytest.approx(0.005, rel=1e-3)
    assert report.hardware.launch_overhead_s == pytest.approx(5e-6, rel=1e-3)
    assert report.holdout_ops == 6 and report.holdout_median_rel_error < 1e-3
    assert report.unfitted_classes == ("elementwise",)  # 0-FLOP ops: its efficiency is inert, not fitted
    import yaml

    from slackswap.hardware import Hardware

    text = preset_yaml(report, {"name": "x", **{k: v for k, v in yaml.safe_load(
        (Path(__file__).resolve().parents[1] / "conf/hardware/h200_sxm_pcie5.yaml").read_text()).items()}},
        ["fitted in a test"])
    loaded = Hardware.from_dict(yaml.safe_load(text))
    assert loaded.name == "fitted" and loaded.efficiency["matmul"] == pytest.approx(0.02, rel=1e-3)
    assert text.startswith("# fitted in a test") and "fit on all 30 ops" in text and "without 6 of them" in text


def test_the_fitted_preset_times_the_keep_all_step_it_was_fitted_on():
    """`roofline_step_s`, what the cross-shape benchmark predicts a shape's keep-all step with: on the
    preset that made the op times it is their sum, on a preset twice as fast at GEMMs it is less by half of
    the matmuls' share."""
    from dataclasses import replace as dc_replace

    from slackswap.graph import OpClass
    from slackswap.hardware import load_preset
    from slackswap.profile.fit import roofline_step_s
    from slackswap.profile.timing import op_duration_s

    base = load_preset("h200_sxm_pcie5")
    truth = dc_replace(base, efficiency={"matmul": 0.02, "attention": 0.005, "elementwise": 1.0},
                       hbm_efficiency=0.01, launch_overhead_s=0.0)
    g = _roofline_graph()
    times = {op.name: op_duration_s(op.flops, op.moved_bytes, op.op_class, "bf16", truth) for op in g.ops}
    assert roofline_step_s(g, truth, "bf16") == pytest.approx(sum(times.values()), rel=1e-12)
    faster = dc_replace(truth, efficiency={**truth.efficiency, "matmul": 0.04})
    matmuls = sum(times[op.name] for op in g.ops if op.op_class == OpClass.MATMUL)
    assert roofline_step_s(g, faster, "bf16") == pytest.approx(sum(times.values()) - matmuls / 2, rel=1e-12)


def test_the_preset_is_fitted_on_every_op_and_the_check_fit_on_the_rest():
    """The ops the check fit leaves out still shape the preset: where they alone run slower than the
    roofline that made the others, the preset's sum over every op matches the measured sum, while the
    check fit (which never saw them) misses their sum and says so."""
    from dataclasses import replace as dc_replace

    from slackswap.hardware import load_preset
    from slackswap.profile.fit import fit_preset
    from slackswap.profile.timing import op_duration_s

    base = load_preset("h200_sxm_pcie5")
    truth = dc_replace(base, efficiency={"matmul": 0.02, "attention": 0.005, "elementwise": 1.0},
                       hbm_efficiency=0.01, launch_overhead_s=5e-6)
    g = _roofline_graph()
    measured = {op.name: op_duration_s(op.flops, op.moved_bytes, op.op_class, "bf16", truth) for op in g.ops}
    held = {op.name for i, op in enumerate(g.ops) if i % 5 == 4}
    measured = {name: t * (3.0 if name in held else 1.0) for name, t in measured.items()}
    report = fit_preset(g, measured, base, "bf16", holdout_every=5)
    assert report.fit_ops == len(g.ops) and report.holdout_ops == len(held)
    assert report.holdout_sum_rel_error < -0.5  # the check fit, blind to the slow ops, is far under them
    share = sum(measured[n] for n in held) / sum(measured.values())
    # over every op, a preset blind to them would miss by that times their share of the time (~ -30 %)
    assert abs(report.fit_sum_rel_error) < abs(report.holdout_sum_rel_error) * share / 3


def test_the_fit_refuses_too_few_ops():
    from slackswap.hardware import load_preset
    from slackswap.profile.fit import fit_preset

    g = _graph()
    with pytest.raises(ConfigError, match="measured ops"):
        fit_preset(g, {op.name: 1e-3 for op in g.ops}, load_preset("h200_sxm_pcie5"), "bf16")


def test_the_cross_shape_benchmark_counts_rounds_within_15_percent_per_fit_and_side():
    from benchmarks.cross_shape_fit import summary

    def row(every: float, check: float) -> dict:
        sides = ("op_sum", "plain_step", "train_step")
        return {"every_op": {f"vs_{s}": every for s in sides}, "check_fit": {f"vs_{s}": check for s in sides}}

    s = summary([row(0.05, -0.20), row(-0.15, 0.16), row(0.01, 0.02)])
    assert s["every_op_vs_op_sum"] == {"median": 0.01, "min": -0.15, "max": 0.05, "within_15pct": 3, "rounds": 3}
    assert s["check_fit_vs_train_step"]["within_15pct"] == 1 and s["check_fit_vs_train_step"]["median"] == 0.02
