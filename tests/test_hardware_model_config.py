"""Every preset loads into the library types and builds a graph; bad input names the field and value."""

import re
from pathlib import Path

import pytest
import yaml

from slackswap.errors import ConfigError
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.profile import build_graph

CONF = Path(__file__).resolve().parents[1] / "conf"
# Analytic presets only: a torch preset (a `torch` node, composed by Hydra from an analytic parent) is
# loaded and traced in tests/test_torch_profile.py and tests/test_config.py.
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml") if "torch" not in yaml.safe_load(p.read_text()))
HARDWARE = sorted(p.stem for p in (CONF / "hardware").glob("*.yaml"))


def load(group: str, name: str) -> dict:
    """A preset's keys; a traced preset (docs/torch_profile.md) inherits its analytic preset's keys
    through its defaults list and adds a `torch` node, which is not a ModelConfig field."""
    data = yaml.safe_load((CONF / group / f"{name}.yaml").read_text())
    # Base presets are names; a group override (an MoE preset's `model_kind`) is a mapping, not a base.
    bases = [d for d in data.pop("defaults", []) if isinstance(d, str) and d != "_self_"]
    for base in bases:
        data = {**load(group, base), **data}
    data.pop("torch", None)
    return data


def test_the_required_presets_exist():
    assert {"bert_large", "gpt2_xl", "llama7b", "llama2_70b", "tiny"} <= set(MODELS)
    gpus = {"a100_80gb_pcie4", "a100_80gb_sxm_pcie4", "a100_40gb_pcie4", "v100_pcie3", "h100_pcie5"}
    assert gpus | {"h100_sxm_pcie5", "h200_sxm_pcie5", "gh200_c2c"} <= set(HARDWARE)


#: Issue 42's GPU generations, each with a preset on a fitted efficiency set (the A100 or the H100 fit).
GENERATIONS = {
    "NVIDIA A100 40GB PCIe": "a100_40gb_pcie_calibrated", "NVIDIA A100 40GB SXM4": "a100_40gb_sxm_calibrated",
    "NVIDIA A100 80GB PCIe": "a100_80gb_pcie_calibrated", "NVIDIA A100 80GB SXM4": "a100_80gb_sxm_calibrated",
    "NVIDIA H100 PCIe 80GB": "h100_pcie5", "NVIDIA H100 SXM5 80GB": "h100_sxm_calibrated",
    "NVIDIA H200 SXM 141GB": "h200_sxm_pcie5", "NVIDIA GH200 Grace Hopper Superchip 96GB HBM3": "gh200_c2c",
}


@pytest.mark.parametrize(("sku", "name"), GENERATIONS.items())
def test_every_gpu_generation_has_a_preset_on_a_fit(sku, name):
    hw = Hardware.from_dict(load("hardware", name))
    fit = Hardware.from_dict(load("hardware", "h100_sxm_calibrated" if "H" in sku.split()[1] else
                                  "a100_80gb_sxm_calibrated"))
    assert hw.sku == sku
    assert (dict(hw.efficiency), hw.hbm_efficiency) == (dict(fit.efficiency), fit.hbm_efficiency)
    assert hw.collective_overlap_slowdown == fit.collective_overlap_slowdown > 0


@pytest.mark.parametrize("name", HARDWARE)
def test_a_seed_era_preset_says_so_and_names_a_preset_on_a_fit(name):
    """The presets that keep the shared seed-era figures say so in their header, and an A100 one names
    its twin on the A100 fit, which exists."""
    text = (CONF / "hardware" / f"{name}.yaml").read_text()
    hw = Hardware.from_dict(load("hardware", name))
    if hw.collective_overlap_slowdown > 0:
        assert "Seed-era" not in text
        return
    assert "Seed-era efficiencies" in text and hw.hbm_efficiency == 0.8
    twins = re.findall(r"use (\w+_calibrated)", " ".join(text.split()))
    assert bool(twins) == name.startswith("a100"), name
    assert all(t in HARDWARE for t in twins)


@pytest.mark.parametrize("name", MODELS)
def test_model_presets_load_and_build(name):
    data = load("model", name)
    model = ModelConfig.from_dict(data)
    assert model.name == name and model.source
    hw = Hardware.from_dict(load("hardware", "a100_80gb_pcie4"))
    small = ModelConfig.from_dict({**data, "num_layers": 2})
    graph = build_graph(small, hw)
    assert graph.num_layers == 2 and graph.saved_tensors


@pytest.mark.parametrize("name", HARDWARE)
def test_hardware_presets_load_and_time_a_graph(name):
    hw = Hardware.from_dict(load("hardware", name))
    assert hw.name == name and hw.source
    assert all(isinstance(v, float) for v in hw.peak_flops_per_s.values())  # YAML floats, not strings
    dtype = "bf16" if "bf16" in hw.peak_flops_per_s else "fp16"
    model = ModelConfig.from_dict({**load("model", "tiny"), "dtype": dtype})
    assert sum(op.duration_s for op in build_graph(model, hw).ops) > 0


SHARED_EFFICIENCY = {"matmul": 0.7, "attention": 0.5, "elementwise": 1.0}
#: Hopper parts: they carry the H100 fit, not the A100's shared figures (issue 42).
HOPPER = ("h100_pcie5", "h100_sxm_pcie5", "h200_sxm_pcie5", "gh200_c2c", "h100_sxm_calibrated")


@pytest.mark.parametrize("name", HOPPER)
def test_no_hopper_preset_plans_on_a100_efficiencies(name):
    hw = Hardware.from_dict(load("hardware", name))
    ref = Hardware.from_dict(load("hardware", "h100_sxm_calibrated"))
    a100 = Hardware.from_dict(load("hardware", "a100_80gb_sxm_pcie4"))
    assert dict(hw.efficiency) == dict(ref.efficiency) and hw.hbm_efficiency == ref.hbm_efficiency
    assert dict(hw.attention_kernels) == dict(ref.attention_kernels)
    assert hw.collective_overlap_slowdown == ref.collective_overlap_slowdown
    assert hw.efficiency["matmul"] != a100.efficiency["matmul"] and hw.hbm_efficiency != a100.hbm_efficiency


def test_a_named_attention_kernel_times_attention_at_its_own_efficiency():
    """FlashAttention-3 on an H100 preset runs at its cited 0.75, FlashAttention-2 at 0.35; a kernel the
    preset does not list, or none, at the generic attention efficiency; matmuls never change."""
    hw = Hardware.from_dict(load("hardware", "h100_sxm_calibrated"))
    base = {**load("model", "gpt2_xl"), "num_layers": 2, "attention": "flash"}

    def split(kernel: str) -> tuple[float, float]:
        ops = build_graph(ModelConfig.from_dict({**base, "attention_kernel": kernel}), hw).ops
        att = sum(op.duration_s for op in ops if op.op_class == "attention")
        return att, sum(op.duration_s for op in ops if op.op_class == "matmul")

    (a3, m3), (a2, m2), (a0, m0), (ac, mc) = split("flash3"), split("flash2"), split(""), split("cudnn")
    assert m3 == m2 == m0 == mc
    assert a2 == a0 == ac and a3 < a2
    # compute-bound but for launch gaps and memory-bound tails: close to 0.35 / 0.75 of the time
    assert a2 * 0.35 / 0.75 <= a3 <= a2 * 0.5
#: A per-GPU efficiency must cite its source in the preset file.
EFFICIENCY_SOURCES = {("attention", 0.35): "Shah et al. 2024"}


@pytest.mark.parametrize("name", HARDWARE)
def test_efficiencies_are_shared_or_cited_per_gpu(name):
    hw = Hardware.from_dict(load("hardware", name))
    text = (CONF / "hardware" / f"{name}.yaml").read_text()
    if name.endswith("_calibrated") or name in HOPPER:
        # fitted once per GPU by benchmarks/calibration.py (tests/test_calibration.py checks the fit)
        assert "benchmarks/calibration.py" in text and "fitted" in text
        return
    assert hw.hbm_efficiency == 0.8 and "Shared value" in text
    for op_class, value in hw.efficiency.items():
        if value != SHARED_EFFICIENCY[op_class]:
            assert EFFICIENCY_SOURCES[(op_class, value)] in text, (name, op_class, value)


@pytest.mark.parametrize("name", HARDWARE)
def test_every_preset_names_its_exact_sku(name):
    hw = Hardware.from_dict(load("hardware", name))
    assert hw.sku.startswith("NVIDIA ")
    form = "SXM" if "sxm" in name else "PCIe" if name.startswith(("a100", "h100", "v100")) else ""
    assert form in hw.sku, (name, hw.sku)


def test_pcie_cards_carry_their_own_datasheet_figures():
    h100 = Hardware.from_dict(load("hardware", "h100_pcie5"))
    assert (h100.peak_flops_per_s["bf16"], h100.hbm_bytes_per_s, h100.link.name) == (756e12, 2.0e12, "pcie5_x16")
    sxm = Hardware.from_dict(load("hardware", "h100_sxm_pcie5"))
    assert (sxm.peak_flops_per_s["bf16"], sxm.hbm_bytes_per_s, sxm.link.name) == (989e12, 3.35e12, "pcie5_x16")
    assert Hardware.from_dict(load("hardware", "a100_80gb_pcie4")).hbm_bytes_per_s == 1.935e12
    assert Hardware.from_dict(load("hardware", "a100_80gb_sxm_pcie4")).hbm_bytes_per_s == 2.039e12


def test_gh200_link_is_asymmetric():
    link = Hardware.from_dict(load("hardware", "gh200_c2c")).link
    assert link.h2d_effective_bytes_per_s == 410e9 and link.d2h_effective_bytes_per_s == 170e9
    assert link.d2h_theoretical_bytes_per_s == link.h2d_theoretical_bytes_per_s == 450e9


def test_attention_is_a_one_key_override():
    model = ModelConfig.from_dict({**load("model", "gpt2_xl"), "attention": "flash"})
    assert model.attention == "flash"


GOOD = load("model", "tiny")


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"hidden_size": 66}, r"model.hidden_size=66: is not divisible by model.num_heads=4"),
        ({"family": "llama", "dropout": False, "num_kv_heads": 3}, r"model.num_kv_heads=3: does not divide"),
        ({"num_layers": 0}, r"model.num_layers=0"),
        ({"seq_len": -5}, r"model.seq_len=-5"),
        ({"micro_batch_size": 0}, r"model.micro_batch_size=0"),
        ({"vocab_size": -1}, r"model.vocab_size=-1"),
        ({"dtype": "int8"}, r"model.dtype='int8'"),
        ({"attention": "sdpa"}, r"model.attention='sdpa'"),
        ({"attention_kernel": "xformers"}, r"model.attention_kernel='xformers': unknown kernel"),
        ({"attention": "eager", "attention_kernel": "flash2"}, r"model.attention_kernel='flash2': does not run"),
        ({"num_layer": 3}, r"model=\['num_layer'\]"),
    ],
)
def test_bad_model_input_names_field_and_value(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_dict({**GOOD, **overrides})


HW_GOOD = load("hardware", "a100_80gb_pcie4")


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda d: d["efficiency"].pop("attention"), r"hardware.efficiency.attention=None: op class has no efficiency"),
        (lambda d: d["efficiency"].update(conv=0.5), r"hardware.efficiency.conv=0.5: unknown op class"),
        (lambda d: d["peak_flops_per_s"].update(int8=1e15), r"hardware.peak_flops_per_s.int8"),
        (lambda d: d.update(hbm_bytes_per_s=0), r"hardware.hbm_bytes_per_s=0"),
        (lambda d: d["link"].update(d2h_effective_bytes_per_s=40e9), r"link.d2h_effective_bytes_per_s=4"),
        (lambda d: d.update(hbm_efficiency=1.5), r"hardware.hbm_efficiency=1.5"),
        (lambda d: d.update(attention_kernels={"flash9": 0.5}), r"hardware.attention_kernels.flash9=0.5: unknown"),
        (lambda d: d.update(attention_kernels={"flash2": 1.2}), r"hardware.attention_kernels.flash2=1.2"),
    ],
)
def test_bad_hardware_input_names_field_and_value(mutate, pattern):
    data = yaml.safe_load((CONF / "hardware" / "a100_80gb_pcie4.yaml").read_text())
    mutate(data)
    with pytest.raises(ConfigError, match=pattern):
        Hardware.from_dict(data)
