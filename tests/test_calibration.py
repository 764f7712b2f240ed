"""Calibrated compute: the committed calibration.json is what the committed presets give, rows are
counted within 10 % fitted and held out apart, the fit reproduces the presets' efficiencies, and
every Hopper preset carries the H100 fit."""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks import calibration
from benchmarks.common import REPO, RESULTS
from slackswap.simulate.metrics import simulate_ideal


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return calibration.evaluate()


def test_committed_json_is_what_the_presets_give_now(rows) -> None:
    committed = json.loads((RESULTS / "calibration.json").read_text())
    assert [r["name"] for r in committed["rows"]] == [r["name"] for r in rows]
    for old, new in zip(committed["rows"], rows, strict=True):
        assert old["ratio"] == pytest.approx(new["ratio"], abs=1e-4), old["name"]
        assert set(old) >= {"name", "source", "simulated", "published", "ratio", "held_out", "within_10pct"}
    assert committed["summary"] == calibration.summary(rows)


def test_rows_within_10_percent_fitted_and_held_out_apart(rows) -> None:
    held_out = [r for r in rows if r["held_out"]]
    fitted = [r for r in rows if not r["held_out"]]
    assert len(held_out) >= 5 and len(fitted) >= 5
    for part in (held_out, fitted):
        assert sum(abs(r["ratio"] - 1) <= 0.10 for r in part) >= 0.9 * len(part)
    # the calibration earns its keep: the seed-era efficiencies meet fewer rows
    s = calibration.summary(rows)
    assert s["all"]["within_10pct"] > s["all"]["seed_within_10pct"]


def test_every_row_quotes_its_source_line() -> None:
    for m in calibration.MEASUREMENTS:
        published = f"{m.published:,.0f}" if m.published >= 1000 else f"{m.published:g}"
        assert published in m.source, (m.name, published)


def test_the_step_is_the_simulators_keep_all_step() -> None:
    """The benchmark's step (a sum of op durations) is what the simulator gives keep-all, no budget."""
    meas = next(m for m in calibration.MEASUREMENTS if m.name == "gpt_1.3b_flash2_a100")
    model, training = calibration.workload(meas)
    hw = calibration.hardware(calibration.PRESETS["a100"])
    from slackswap.profile import build_graph

    assert calibration.step_s(meas, hw) == pytest.approx(simulate_ideal(build_graph(model, hw, training), hw).step_s,
                                                         rel=1e-9)


@pytest.mark.slow
def test_the_fit_reproduces_the_calibrated_presets() -> None:
    fits = calibration.fit_all()
    a100 = yaml.safe_load((REPO / "conf/hardware/a100_80gb_sxm_calibrated.yaml").read_text())
    for key in ("matmul", "attention"):
        assert fits["a100"][key] == pytest.approx(a100["efficiency"][key], abs=0.006)
    for key in ("eager", "flash1"):
        assert fits["a100"][key] == pytest.approx(a100["attention_kernels"][key], abs=0.006)
    assert fits["a100"]["hbm"] == pytest.approx(a100["hbm_efficiency"], abs=0.006)
    h100 = yaml.safe_load((REPO / "conf/hardware/h100_sxm_calibrated.yaml").read_text())
    assert fits["h100"]["matmul"] == pytest.approx(h100["efficiency"]["matmul"], abs=0.006)
    assert h100["hbm_efficiency"] == round(fits["a100"]["hbm"], 2)


@pytest.mark.parametrize("gpu", sorted(calibration.PRESETS))
def test_calibrated_presets_change_only_the_efficiencies(gpu: str) -> None:
    new = yaml.safe_load((REPO / "conf/hardware" / f"{calibration.PRESETS[gpu]}.yaml").read_text())
    old = yaml.safe_load((REPO / "conf/hardware" / f"{calibration.BASE_PRESETS[gpu]}.yaml").read_text())
    for key in ("name", "source", "efficiency", "hbm_efficiency", "attention_kernels"):
        new.pop(key, None), old.pop(key, None)
    assert new == old


def test_no_model_gets_its_own_efficiency(rows) -> None:
    """One efficiency set per GPU: every row of one GPU runs on the same preset."""
    by_gpu: dict[str, set[str]] = {}
    for m, r in zip(calibration.MEASUREMENTS, rows, strict=True):
        by_gpu.setdefault(m.gpu, set()).add(r["hardware"])
    assert all(len(presets) == 1 for presets in by_gpu.values())
