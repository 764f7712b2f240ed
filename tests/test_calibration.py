"""Calibrated compute: the committed calibration.json is what the committed presets give, rows are
counted within 10 % fitted and held out apart, the presets hold the fit their rows give, and every
Hopper preset carries the H100 fit. The fit with n_half (a global search, about a minute) is the
benchmarks' check (`python benchmarks/calibration_fit.py --check`)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import yaml

from benchmarks import calibration
from benchmarks.common import REPO, RESULTS
from slackswap.profile import build_graph
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
    """At least 30 rows; 90 % of the fitted sources' rows, of the fitted and of the held-out rows within
    10 % (issue 42's target), on the A100 alone too; every miss, independent rows' included, is one the
    script explains. The independent rows are the check no fit saw, counted apart (their own test)."""
    own = [r for r in rows if not r["independent"]]
    held_out = [r for r in own if r["held_out"]]
    fitted = [r for r in own if not r["held_out"]]
    assert len(own) >= 30 and len(held_out) >= 10 and len(fitted) >= 10
    assert sum(r["within_10pct"] for r in fitted) >= 0.9 * len(fitted)
    assert sum(r["within_10pct"] for r in held_out) >= 0.9 * len(held_out)
    assert sum(r["within_10pct"] for r in own) >= 0.9 * len(own)
    a100_held = [r for r in held_out if r["hardware"] == calibration.PRESETS["a100"]]
    assert sum(r["within_10pct"] for r in a100_held) >= 0.9 * len(a100_held)
    # the A100 fit on the 40GB part, checked only on rows it never saw: 39 of 45 of its table when written
    # (and the micro-batch sweep's 3B row)
    a100_40gb = [r for r in rows if r["hardware"] == calibration.PRESETS["a100_40gb"]]
    assert len(a100_40gb) == 46 and all(r["held_out"] for r in a100_40gb)
    assert sum(r["within_10pct"] for r in a100_40gb) >= 0.85 * len(a100_40gb)
    assert {r["name"] for r in rows if not r["within_10pct"]} == set(calibration.KNOWN_MISSES)
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

    assert calibration.step_s(meas, hw) == pytest.approx(simulate_ideal(build_graph(model, hw, training), hw).step_s,
                                                         rel=1e-9)


def test_held_out_rows_follow_the_stated_rule() -> None:
    """Every third llm-foundry row of the fitted GPUs' tables in source order is held out, whatever its
    ratio; every A100 40GB row and every row of the micro-batch sweep is held out (no fit uses them)."""
    from benchmarks.calibration_rows import FOUNDRY_40GB_ROWS, FOUNDRY_ROWS, SWEEP_ROWS

    foundry = [m for m in calibration.MEASUREMENTS if m.sharding and not m.independent]
    assert len(foundry) == len(FOUNDRY_ROWS) + len(FOUNDRY_40GB_ROWS) + len(SWEEP_ROWS)
    assert [m.held_out for m in foundry] == [i % 3 == 2 for i in range(len(FOUNDRY_ROWS))] + [True] * (
        len(FOUNDRY_40GB_ROWS) + len(SWEEP_ROWS))
    lines = [row[1] for row in (*FOUNDRY_ROWS, *FOUNDRY_40GB_ROWS)] + [row[0] for row in SWEEP_ROWS]
    assert all(f"line {line}:" in m.source for m, line in zip(foundry, lines, strict=True))
    table40 = foundry[len(FOUNDRY_ROWS):len(FOUNDRY_ROWS) + len(FOUNDRY_40GB_ROWS)]
    assert all(m.gpu == "a100_40gb" and "A100 40GB" in m.source for m in table40)
    assert all("larger_mb_1.md" in m.source for m in foundry[-len(SWEEP_ROWS):])


def test_collectives_slow_small_micro_batches_more() -> None:
    """Per-micro-batch FSDP collectives cost the same at any micro-batch, so a smaller micro-batch of
    the same run loses a larger share of its step to them."""
    from dataclasses import replace

    meas = next(m for m in calibration.MEASUREMENTS if m.name == "mpt13b_s2048_g8_mb2_h100")
    hw = calibration.hardware(calibration.PRESETS["h100"])
    free = replace(hw, collective_overlap_slowdown=0.0)

    def share(mb: int) -> float:
        m = replace(meas, micro_batch_size=mb)
        return calibration.step_s(m, hw) / calibration.step_s(m, free) - 1

    assert share(1) > share(8) > 0


def test_the_micro_batch_sweep_follows_the_published_trend(rows) -> None:
    """llm-foundry's A100 micro-batch sweep (the same 7B run at micro-batch 1, 2, 4 and 6): tokens/s
    per GPU grow with the micro-batch as published (+34 % from 1 to 4), within 5 points at each step,
    on the A100 fit (which carries no rate-limiter stall: it would make micro-batch 1 dearer)."""
    sweep = {r["name"]: r for r in rows if r["name"].startswith("mpt7b_s2048_g8_mb") and r["name"].endswith("_sweep")}
    by_mb = {int(n.split("_mb")[1].split("_")[0]): r for n, r in sweep.items()}
    assert sorted(by_mb) == [1, 2, 4, 6]
    for small, large in ((1, 2), (2, 4), (4, 6), (1, 4)):
        simulated = by_mb[large]["simulated"] / by_mb[small]["simulated"]
        published = by_mb[large]["published"] / by_mb[small]["published"]
        assert abs(simulated - published) < 0.05, (small, large, simulated, published)


def test_the_step_slows_with_the_gpu_count() -> None:
    """The same 1B run on 512 GPUs is slower per GPU than on 128 (published: -9.7 %): each unit's
    collectives pay NCCL's ring latency, which grows with the ranks (slackswap.communication)."""
    rows = {m.name: m for m in calibration.MEASUREMENTS}
    hw = calibration.hardware(calibration.PRESETS["h100"])
    s128 = calibration.step_s(rows["mpt1b_s2048_g128_mb12_h100"], hw)
    s512 = calibration.step_s(rows["mpt1b_s2048_g512_mb12_h100"], hw)
    assert 1.03 < s512 / s128 < 1.2


@pytest.mark.parametrize("gpu", sorted(calibration.BASE_PRESETS))
def test_calibrated_presets_change_only_the_efficiencies(gpu: str) -> None:
    new = yaml.safe_load((REPO / "conf/hardware" / f"{calibration.PRESETS[gpu]}.yaml").read_text())
    old = yaml.safe_load((REPO / "conf/hardware" / f"{calibration.BASE_PRESETS[gpu]}.yaml").read_text())
    for key in ("name", "source", "efficiency", "hbm_efficiency", "attention_kernels", "collective_overlap_slowdown",
                "rate_limited_all_gather_s"):
        new.pop(key, None), old.pop(key, None)
    assert new == old


def test_no_model_gets_its_own_efficiency(rows) -> None:
    """One efficiency set per GPU: every row of one GPU runs on the same preset."""
    by_gpu: dict[str, set[str]] = {}
    for m, r in zip(calibration.MEASUREMENTS, rows, strict=True):
        by_gpu.setdefault(m.gpu, set()).add(r["hardware"])
    assert all(len(presets) == 1 for presets in by_gpu.values())


def test_the_mpt7b_preset_runs_the_benchmarks_attention_kernel() -> None:
    """conf/model/mpt7b.yaml is llm-foundry's benchmark shape, checked in docs/advise.md against the same
    table the calibration rows come from: it names the kernel those runs used (attn_impl: triton), so a
    Hopper or calibrated preset times its attention as the calibration does, not at the generic figure."""
    preset = yaml.safe_load((REPO / "conf/model/mpt7b.yaml").read_text())
    kernels = {m.model["attention_kernel"] for m in calibration.MEASUREMENTS if m.sharding and not m.independent}
    assert kernels == {"triton"} and preset.get("attention_kernel") == "triton"


def _fitted_rows(gpu: str) -> int:
    return sum(m.gpu == gpu and m.sharding != "" and not m.held_out for m in calibration.MEASUREMENTS)


@pytest.mark.parametrize("name", [*calibration.HOPPER_PRESETS, *calibration.A100_PRESETS, "h100_sxm_calibrated",
                                  "a100_80gb_sxm_calibrated"])
def test_each_fitted_preset_counts_the_rows_it_was_fitted_on(name: str) -> None:
    """A preset's comment names how many llm-foundry (MPT) rows its fit used: the count the fit uses now
    (it said 29 and 20 after the table grew to 30 fitted H100 rows and 16 fitted A100 MPT rows)."""
    gpu = "a100" if name.startswith("a100") else "h100"
    text = " ".join((REPO / "conf/hardware" / f"{name}.yaml").read_text().split())
    counts = {int(n) for n in re.findall(r"(\d+) MPT runs", text)}
    assert counts == {_fitted_rows(gpu)}, (name, counts)


#: How the docs quote a preset's fit: "H100 fit ... (matmul 0.66, HBM 0.40" and "the calibrated A100
#: (0.85 with HBM 0.42)"; the calibration benchmark's own "--fit" comment lines are checked by the fit test.
FIT_QUOTES = {
    "h100_sxm_calibrated": re.compile(r"H100 fit[^(]{0,40}\(matmul (\d\.\d+), HBM (\d\.\d+)"),
    "a100_80gb_sxm_calibrated": re.compile(r"calibrated A100 \((?:matmul )?(\d\.\d+) with HBM (\d\.\d+)\)"),
}


def test_docs_quote_the_fit_the_presets_hold() -> None:
    """Every place a doc quotes a calibrated preset's matmul and HBM figures quotes the committed ones
    (docs/profile.md still gave the Hopper fit as matmul 0.53, HBM 0.61 two refits later)."""
    found = 0
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = " ".join(path.read_text().split())
        for name, pattern in FIT_QUOTES.items():
            preset = yaml.safe_load((REPO / "conf/hardware" / f"{name}.yaml").read_text())
            for matmul, hbm in pattern.findall(text):
                found += 1
                assert (float(matmul), float(hbm)) == (preset["efficiency"]["matmul"], preset["hbm_efficiency"]), \
                    (path.name, name, matmul, hbm)
    assert found >= 3


def test_every_row_names_the_line_or_table_it_is_read_from() -> None:
    """A row's source names where in it the figure stands: a file's line (the README tables) or a
    paper's table, so a reader can check the transcription (the BERT rows named only their section)."""
    rows = [*calibration.MEASUREMENTS, *(m for m, _ in calibration.EXCLUDED)]
    for m in rows:
        assert re.search(r"\bline \d+\b|\bTable \d+\b", m.source), m.name


FIT_KEYS = ("efficiency", "hbm_efficiency", "attention_kernels", "collective_overlap_slowdown",
            "rate_limited_all_gather_s")


def _preset(name: str) -> dict:
    return yaml.safe_load((REPO / "conf/hardware" / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", calibration.A100_PRESETS)
def test_other_a100_parts_carry_the_a100_fit_on_their_own_memory(name: str) -> None:
    """The 40GB SXM4 module and the PCIe cards hold a100_80gb_sxm_calibrated's efficiencies; every other
    figure is the part's own: the 40GB module differs from the 80GB one in its memory alone, a PCIe card
    is its seed-era preset with the fit."""
    new, fit = _preset(name), _preset(calibration.PRESETS["a100"])
    assert all(new[k] == fit[k] for k in FIT_KEYS), name
    twin = fit if "sxm" in name else _preset(name.replace("_pcie_calibrated", "_pcie4"))
    differ = {k for k in new.keys() | twin.keys() if new.get(k) != twin.get(k)}
    memory = {"hbm_bytes_per_s", "device_memory_bytes", "sku"}
    assert differ == {"name", "source"} | (memory if twin is fit else set(FIT_KEYS)), (name, differ)
    if "40gb" in name:
        assert (new["hbm_bytes_per_s"], new["device_memory_bytes"]) == (1.555e12, 40 * 2**30)


def test_every_fitted_or_derived_preset_is_checked_or_says_why_not(rows) -> None:
    """A preset carrying a fit either runs calibration rows or is listed as unchecked with its reason
    (h100_sxm_pcie5 is h100_sxm_calibrated's part and figures, checked through it)."""
    carrying = {*calibration.A100_PRESETS, *calibration.HOPPER_PRESETS}
    checked = {r["hardware"] for r in rows} | {"h100_sxm_pcie5"}
    assert set(calibration.UNCHECKED) == carrying - checked
    assert all(calibration.UNCHECKED.values())


def test_the_fit_check_flags_a_preset_that_strays_from_its_fit() -> None:
    """`calibration_fit.py --check` (the benchmarks' check that the presets hold the fit; the fit itself
    takes a minute, so no unit test runs it) passes on the committed presets' own figures and names a
    preset whose figure strays beyond its rounding, n_half included (read in GFLOP)."""
    from benchmarks import calibration_fit

    fits = {gpu: {"kept": calibration_fit.preset_values(calibration.PRESETS[gpu])} for gpu in ("a100", "h100")}
    assert calibration_fit.check(fits) == []
    fits["h100"]["kept"] = fits["h100"]["kept"] | {"n_half_matmul": 5.0}
    bad = calibration_fit.check(fits)
    assert bad and all("n_half_matmul" in line for line in bad)
    assert {line.split(":")[0] for line in bad} == {"h100_sxm_calibrated", *calibration.HOPPER_PRESETS}


def _committed() -> dict:
    return json.loads((RESULTS / "calibration.json").read_text())


def test_independent_rows_are_held_out_and_cite_their_source_line() -> None:
    """Every independent row comes from a source no fit reads (not llm-foundry, the FlashAttention-2
    paper or DeepLearningExamples), is held out (so calibration_fit never uses it), names the commit
    and line it is read from and quotes the table line; the json marks the same rows."""
    from benchmarks.calibration_rows import INDEPENDENT_ROWS

    independent = [m for m in calibration.MEASUREMENTS if m.independent]
    assert len(independent) == len(INDEPENDENT_ROWS) >= 10
    for m, row in zip(independent, INDEPENDENT_ROWS, strict=True):
        assert m.held_out and calibration.family(m) in {"torchtitan", "fms-fsdp"}, m.name
        assert re.search(r"\(commit [0-9a-f]{12}", m.source) and f"line {row[1]}: {row[2]}" in m.source, m.name
    committed = {r["name"]: r for r in _committed()["rows"]}
    assert {n for n, r in committed.items() if r["independent"]} == {m.name for m in independent}


def test_summary_counts_independent_rows_apart() -> None:
    """The committed summary counts the independent rows in their own part, never among the fitted or
    held-out rows, and per source family; the parts add up to all rows."""
    committed = _committed()
    s, rows = committed["summary"], committed["rows"]
    assert s["independent"]["rows"] == sum(r["independent"] for r in rows) > 0
    assert s["fitted"]["rows"] + s["held_out"]["rows"] + s["independent"]["rows"] == s["all"]["rows"] == len(rows)
    assert s["held_out"]["rows"] == sum(r["held_out"] and not r["independent"] for r in rows)
    assert sum(p["rows"] for p in s["by_family"].values()) == len(rows)
    assert s["by_family"]["llm-foundry"]["rows"] == 121


def test_slowdown_rows_compare_the_same_run_with_and_without_checkpointing() -> None:
    """Each slowdown row pairs two runs of one source that differ in checkpointing alone, and its
    figures are the pair's step-time ratio (simulated and published) in the committed json."""
    committed = _committed()
    by_name = {m.name: m for m in calibration.MEASUREMENTS}
    assert committed["slowdowns"] == calibration.slowdowns(committed["rows"]) and committed["slowdowns"]
    for d in committed["slowdowns"]:
        a, b = by_name[d["keep_all"]], by_name[d["checkpointed"]]
        assert not a.checkpointing and not a.recompute and (b.checkpointing or b.recompute)
        assert (a.model, a.seq_len, a.micro_batch_size, a.shards, a.gpu) == (b.model, b.seq_len, b.micro_batch_size,
                                                                            b.shards, b.gpu)
        assert d["published_pct"] > 0 and d["simulated_pct"] > 0


def test_selective_policies_recompute_less_than_full_checkpointing() -> None:
    """"layers:2" recomputes the forward of every second layer (half the layers' forward time of the
    analytic graph); torchtitan's op policy recomputes some of every layer, less than all of it."""
    from dataclasses import replace


    meas = next(m for m in calibration.MEASUREMENTS if m.name == "torchtitan_llama2_13b_s4096_g64_mb2_op")
    hw = calibration.hardware(calibration.PRESETS[meas.gpu])
    model, training = calibration.workload(meas)
    graph = build_graph(replace(model, num_layers=4), hw, training)
    durations = calibration.durations_on(graph, hw)
    full = sum(op.duration_s for op in graph.ops if str(op.phase) == "forward" and op.layer >= 0)
    half = calibration.recompute_s(replace(meas, recompute="layers:2"), graph, hw, durations)
    assert half == pytest.approx(full / 2, rel=1e-9)
    assert 0 < calibration.recompute_s(meas, graph, hw, durations) < full
    assert calibration.recompute_s(replace(meas, recompute=""), graph, hw, durations) == 0.0
    assert durations == pytest.approx([op.duration_s for op in graph.ops], rel=1e-12)  # re-timing is the builder's


def test_hybrid_shard_all_reduces_each_shard_across_nodes() -> None:
    """HYBRID_SHARD (fms-fsdp's 7b rows) adds the all-reduce of each node's gradient shard across the
    nodes, its rings sharing the node's NICs; FSDP within the node alone would leave it out."""
    from dataclasses import replace

    meas = next(m for m in calibration.MEASUREMENTS if m.sharding == "HYBRID_SHARD")
    hw = calibration.hardware(calibration.PRESETS[meas.gpu])
    hybrid = calibration.micro_collectives(meas, 7_000_000_000, hw)
    alone = calibration.micro_collectives(replace(meas, replicas=1), 7_000_000_000, hw)
    assert meas.replicas > 1 and hybrid.forward_s == alone.forward_s and hybrid.backward_s > 1.5 * alone.backward_s


def test_the_per_gb_overlap_cost_splits_each_phases_bytes_by_its_overlapped_share() -> None:
    """Priced per GB, a step whose collectives all run at one bus rate costs what the per-second rule
    costs at that rate (s/s = s/GB x GB/s), forward and backward each in the share of its seconds that
    compute hides; an exposed first / last unit moves bytes that cost nothing."""
    from dataclasses import replace

    meas = next(m for m in calibration.MEASUREMENTS if m.sharding == "FULL_SHARD" and not m.independent)
    hw = calibration.hardware(calibration.PRESETS[meas.gpu])
    model, training = calibration.workload(meas)
    graph = build_graph(replace(model, num_layers=4), hw, training)
    durations = np.array([op.duration_s for op in graph.ops])
    masks = calibration._phase_masks([str(op.phase) for op in graph.ops], [op.layer for op in graph.ops])
    rate = 150e9  # bytes per second of every collective
    # backward's collective outlasts its compute (most of it exposed), forward's hides
    comm = calibration.MicroCollectives(forward_s=0.02, backward_s=5.0, units=5, forward_bytes=0.02 * rate,
                                        backward_bytes=5.0 * rate)
    per_second = calibration._step_from_masks(meas, masks, durations, comm, 0.7)
    per_gb = calibration._step_from_masks(meas, masks, durations, comm, 0.7 / (rate / 1e9), per_gb=True)
    free = calibration._step_from_masks(meas, masks, durations, comm, 0.0)
    assert per_second > free and per_gb == pytest.approx(per_second, rel=1e-12)
    # the same bytes all in backward, where less of them overlap: they cost less
    lopsided = replace(comm, forward_bytes=0.0, backward_bytes=5.02 * rate)
    assert free < calibration._step_from_masks(meas, masks, durations, lopsided, 0.7 / (rate / 1e9),
                                               per_gb=True) < per_second


def test_fsdp_collectives_count_the_bytes_each_rank_moves() -> None:
    """nccl-tests' bus bytes: an all-gather or reduce-scatter of S bytes over n ranks moves S (n - 1) / n
    through each; FULL_SHARD gathers the 16-bit parameters in forward and again in backward."""
    meas = next(m for m in calibration.MEASUREMENTS if m.sharding == "FULL_SHARD" and m.replicas == 1)
    hw = calibration.hardware(calibration.PRESETS[meas.gpu])
    comm = calibration.micro_collectives(meas, 1_000_000_000, hw)
    share = (meas.shards - 1) / meas.shards
    assert comm.forward_bytes == pytest.approx(2e9 * share)
    assert comm.backward_bytes == pytest.approx((2 + meas.grad_reduce_bytes) * 1e9 * share)


def test_rank_memory_grows_with_the_micro_batch_and_shrinks_with_the_shards() -> None:
    """The estimate printed beside a miss: sharded state plus the step's activation peak, over the part's
    memory; none where the source states no sharding or runs a selective policy."""
    from dataclasses import replace

    from benchmarks.calibration_rank import rank_memory_share

    def share(meas):
        model, training = calibration.workload(meas)
        hw = calibration.hardware(calibration.PRESETS[meas.gpu])
        return rank_memory_share(meas, model, training, build_graph(model, hw, training), hw)

    meas = next(m for m in calibration.MEASUREMENTS if m.name == "mpt13b_s2048_g8_mb4_a100_40gb")
    assert 0 < share(meas) < share(replace(meas, micro_batch_size=8))
    assert share(replace(meas, shards=16)) < share(meas)
    assert share(replace(meas, sharding="")) is None and share(replace(meas, recompute="op")) is None


@pytest.mark.slow
def test_the_fit_reproduces_the_presets_and_their_overlap_rule_fits_better() -> None:
    """Every preset carrying a fit holds the fit its GPU's rows give today (the kept variant only; the
    global search with n_half is the benchmark's, `calibration_fit.py --check`). They charge overlapped
    collectives per second; fitted per GB instead the H100 rows fit far worse, and docs/hardware.md and
    KNOWN_MISSES quote both fits' losses as the fit gives them."""
    from benchmarks import calibration_fit
    from benchmarks.calibration_rows import KNOWN_MISSES

    kept = calibration_fit.kept_fits()
    assert calibration_fit.check(kept) == []
    rules = calibration_fit.overlap_rules(kept)
    docs = " ".join((REPO / "docs/hardware.md").read_text().split())
    for gpu, fits in rules.items():
        assert fits["per_second"]["loss"] <= fits["per_gb"]["loss"], gpu
        for fit in fits.values():
            assert f"loss {fit['loss']:.4f}" in docs, (gpu, fit["loss"])
    assert rules["h100"]["per_gb"]["loss"] > 4 * rules["h100"]["per_second"]["loss"]
    fms = KNOWN_MISSES["fms_llama2_70b_s4096_g96_mb2_full"]
    assert f"{rules['h100']['per_gb']['loss']:.4f}" in fms and f"{rules['h100']['per_second']['loss']:.4f}" in fms
