"""The roofline op-timing model, checked by hand."""

import pytest
import yaml

from slackswap.errors import ConfigError
from slackswap.graph import OpClass
from slackswap.hardware import Hardware, HostLink
from slackswap.profile.timing import op_duration_s


def toy_hardware(**overrides) -> Hardware:
    fields = dict(
        name="toy",
        peak_flops_per_s={"bf16": 100e12, "fp32": 10e12},
        hbm_bytes_per_s=2e12,
        device_memory_bytes=80 * 2**30,
        link=HostLink("link", 32e9, 32e9, 25e9, 25e9, 1e-5),
        efficiency={"matmul": 0.5, "attention": 0.25, "elementwise": 1.0},
        hbm_efficiency=0.5,
        launch_overhead_s=1e-6,
    )
    return Hardware(**{**fields, **overrides})


def test_matmul_is_compute_bound_by_hand():
    # 4096^3 GEMM: 2*4096^3 = 137.4 GFLOP at 100 TFLOP/s * 0.5 -> 2.748779 ms; 3 * 4096^2 * 2 bytes = 96 MiB at
    # 1 TB/s effective -> 0.1 ms. Compute wins.
    n = 4096
    flops = 2.0 * n**3
    moved = 3 * n * n * 2
    expected = flops / 50e12 + 1e-6
    assert op_duration_s(flops, moved, OpClass.MATMUL, "bf16", toy_hardware()) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(2.749779e-3, rel=1e-6)


def test_elementwise_is_memory_bound_by_hand():
    # 1 GB read + written, 0 matmul FLOPs: 2e9 bytes / (2e12 * 0.5) = 2 ms, plus 1 us launch.
    got = op_duration_s(0.0, 2_000_000_000, OpClass.ELEMENTWISE, "bf16", toy_hardware())
    assert got == pytest.approx(2.001e-3, rel=1e-12)


def test_attention_class_uses_its_own_efficiency_and_dtype_peak():
    hw = toy_hardware()
    assert op_duration_s(1e12, 0, OpClass.ATTENTION, "bf16", hw) == pytest.approx(1e12 / 25e12 + 1e-6)
    assert op_duration_s(1e12, 0, OpClass.MATMUL, "fp32", hw) == pytest.approx(1e12 / 5e12 + 1e-6)


def test_unknown_dtype_and_op_class_name_field_and_value():
    hw = toy_hardware()
    with pytest.raises(ConfigError, match=r"model.dtype='fp16'"):
        op_duration_s(1.0, 1, OpClass.MATMUL, "fp16", hw)
    with pytest.raises(ConfigError, match=r"hardware.efficiency.conv"):
        op_duration_s(1.0, 1, "conv", "bf16", hw)
    with pytest.raises(ConfigError, match=r"op.flops=-1.0"):
        op_duration_s(-1.0, 1, OpClass.MATMUL, "bf16", hw)


def test_hardware_without_an_op_class_efficiency_is_rejected():
    with pytest.raises(ConfigError, match=r"hardware.efficiency.attention"):
        toy_hardware(efficiency={"matmul": 0.5, "elementwise": 1.0})


def test_a100_preset_times_a_gemm_at_70_percent_of_312_tflops():
    from pathlib import Path

    conf = Path(__file__).resolve().parents[1] / "conf" / "hardware" / "a100_80gb_pcie4.yaml"
    hw = Hardware.from_dict(yaml.safe_load(conf.read_text()))
    flops = 2.0 * 8192**3
    assert op_duration_s(flops, 0, OpClass.MATMUL, "bf16", hw) == pytest.approx(flops / (0.7 * 312e12) + 4e-6)
