"""profile.csv and the per-layer breakdown."""

import csv
from pathlib import Path

import yaml

from slackswap.formulas import korthikanti_fwd_flops_per_layer, korthikanti_saved_bytes_per_layer
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.profile import build_graph
from slackswap.profile.report import CSV_COLUMNS, LayerProfile, format_breakdown, layer_profile, write_profile_csv

CONF = Path(__file__).resolve().parents[1] / "conf"
HW = Hardware.from_dict(yaml.safe_load((CONF / "hardware" / "a100_80gb_pcie4.yaml").read_text()))


def model(name: str) -> ModelConfig:
    return ModelConfig.from_dict(yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))


def test_gpt2_xl_profile_csv_has_the_formula_bytes_per_layer(tmp_path):
    m = model("gpt2_xl")
    graph = build_graph(m, HW)
    path = write_profile_csv(graph, tmp_path / "profile.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == CSV_COLUMNS == ("layer", "saved_bytes", "fwd_flops", "bwd_flops", "fwd_s", "bwd_s",
                                                    "formula_saved_bytes", "saved_ratio")
    assert [int(r["layer"]) for r in rows] == list(range(48))
    expected = korthikanti_saved_bytes_per_layer(m.seq_len, m.micro_batch_size, m.hidden_size, m.num_heads)
    assert expected == 1024 * 4 * 1600 * 114
    assert all(int(r["saved_bytes"]) == expected for r in rows)
    assert all(int(r["formula_saved_bytes"]) == expected and float(r["saved_ratio"]) == 1.0 for r in rows)
    fwd = korthikanti_fwd_flops_per_layer(m.seq_len, m.micro_batch_size, m.hidden_size)
    assert all(float(r["fwd_flops"]) == fwd and float(r["bwd_flops"]) == 2 * fwd for r in rows)
    # Times read back exactly (repr floats) and equal the in-memory profile.
    profile = layer_profile(graph)
    assert [float(r["fwd_s"]) for r in rows] == [p.fwd_s for p in profile]
    assert all(p.bwd_s > p.fwd_s > 0 for p in profile)


def test_layer_profile_sums_the_ops_of_each_layer():
    graph = build_graph(model("tiny"), HW)
    rows = layer_profile(graph)
    assert all(isinstance(r, LayerProfile) for r in rows)
    assert rows[1].fwd_s == sum(op.duration_s for op in graph.layer_ops(1) if op.phase == "forward")
    assert rows[0].saved_bytes == sum(t.size_bytes for t in graph.saved_tensors if t.layer == 0)


def test_breakdown_names_tensors_bytes_and_flops():
    graph = build_graph(model("tiny"), HW)
    text = format_breakdown(graph)
    assert "L0.softmax.out" in text and "softmax_out" in text
    assert str(layer_profile(graph)[0].saved_bytes) in text
    assert "L0.fc1" in text and "GFLOP" in text
    assert "loss.probs" in text  # the non-layer part is shown too
