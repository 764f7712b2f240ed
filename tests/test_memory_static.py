"""Static memory per GPU by hand against the ZeRO paper and the Megatron-LM docs, and device capacity."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slackswap.errors import ConfigError
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.memory.static import (
    DeviceCapacity,
    capacity_reason,
    optimizer_step_bytes_per_param,
    smallest_fitting_shards,
    static_memory,
)
from slackswap.model_config import ModelConfig
from slackswap.profile import build_graph, parameter_counts


def zero_terms(num_params: int, stage: int, shards: int) -> int:
    """Parameters + gradients + optimizer state (the ZeRO paper's three terms), no gathered buffer."""
    s = static_memory(num_params, 1, TrainingConfig(zero_stage=stage, zero_shards=shards), "bf16")
    return s.params_bytes + s.grads_bytes + s.master_bytes + s.optimizer_state_bytes


def test_mixed_adam_is_2_plus_2_plus_12_bytes_per_parameter():
    # ZeRO section 3.1: GPT-2 with 1.5 B parameters needs at least 24 GB (16 bytes x 1.5 B).
    s = static_memory(1_500_000_000, 1, TrainingConfig(), "bf16")
    assert (s.params_bytes, s.grads_bytes, s.master_bytes, s.optimizer_state_bytes) == (3e9, 3e9, 6e9, 12e9)
    assert s.total_bytes == 24_000_000_000


def test_zero_figure_1_example_7_5b_parameters_over_64_gpus():
    # ZeRO Figure 1: Psi = 7.5 B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    psi = 7_500_000_000
    assert zero_terms(psi, 0, 64) == 120_000_000_000
    assert zero_terms(psi, 1, 64) == 2 * psi + 2 * psi + 12 * psi // 64  # 31.40625 GB
    assert round(zero_terms(psi, 1, 64) / 1e9, 1) == 31.4
    assert round(zero_terms(psi, 2, 64) / 1e9, 1) == 16.6
    assert round(zero_terms(psi, 3, 64) / 1e9, 1) == 1.9


def test_megatron_bytes_per_parameter_table():
    # Megatron-LM distributed optimizer docs: bf16 params + fp32 grads 18 bytes/param; fp32 16.
    p = 1000
    bf16_fp32_grads = static_memory(p, 1, TrainingConfig(grad_buffers="fp32"), "bf16")
    assert bf16_fp32_grads.total_bytes == 18 * p
    assert static_memory(p, 1, TrainingConfig(precision="fp32"), "fp32").total_bytes == 16 * p
    # ... and with the optimizer state sharded over d GPUs: 6 + 12/d.
    sharded = TrainingConfig(grad_buffers="fp32", zero_stage=1, zero_shards=4)
    assert static_memory(p, 1, sharded, "bf16").total_bytes == 6 * p + 12 * p // 4


def test_other_recipes():
    p = 1000
    assert static_memory(p, 1, TrainingConfig(precision="pure16"), "bf16").total_bytes == 8 * p  # 2 + 2 + 2 + 2
    assert static_memory(p, 1, TrainingConfig(optimizer="sgd"), "bf16").total_bytes == 8 * p  # 2 + 2 + master 4
    assert static_memory(p, 1, TrainingConfig(optimizer="sgd", precision="pure16"), "fp16").total_bytes == 4 * p
    # Stage 3 gathers two units' full 16-bit parameters (current + prefetched); shards padded up.
    s = static_memory(1001, 100, TrainingConfig(zero_stage=3, zero_shards=4), "bf16")
    assert (s.params_bytes, s.gathered_params_bytes, s.total_bytes) == (2 * 251, 2 * 2 * 100, 16 * 251 + 400)
    assert optimizer_step_bytes_per_param(TrainingConfig(), "bf16") == 28  # today's Adam op (docs/profile.md)
    assert optimizer_step_bytes_per_param(TrainingConfig(precision="fp32"), "fp32") == 28
    assert optimizer_step_bytes_per_param(TrainingConfig(optimizer="sgd"), "bf16") == 12


def test_parameter_counts_match_the_graph_and_the_released_models():
    conf = Path(__file__).resolve().parents[1] / "conf"
    model = ModelConfig.from_dict(yaml.safe_load((conf / "model/llama7b.yaml").read_text()))
    # LLaMA-7B: 6,738,415,616 parameters; the largest group is embeddings + head + final norm.
    assert parameter_counts(model) == (LLAMA7B_PARAMS, 2 * 32000 * 4096 + 4096)
    small = ModelConfig.from_dict(yaml.safe_load((conf / "model/tiny.yaml").read_text()))
    hw = Hardware.from_dict(yaml.safe_load((conf / "hardware/a100_80gb_pcie4.yaml").read_text()))
    graph = build_graph(small, hw)
    assert parameter_counts(small) == (graph.meta["num_params"], graph.meta["max_unit_params"])


def test_bad_training_values_name_the_field():
    with pytest.raises(ConfigError, match="training.optimizer"):
        TrainingConfig(optimizer="adam8bit")
    with pytest.raises(ConfigError, match="training.zero_shards"):
        TrainingConfig(zero_shards=0)
    with pytest.raises(ConfigError, match="training.zero_stage"):
        TrainingConfig(zero_stage=4)
    with pytest.raises(ConfigError, match=r"^training.fsdp_api='FSDP': unknown FSDP API; known: "):
        TrainingConfig(fsdp_api="FSDP")
    with pytest.raises(ConfigError, match="training.precision"):
        static_memory(10, 1, TrainingConfig(precision="fp32"), "bf16")
    with pytest.raises(ConfigError, match="training"):
        TrainingConfig.from_dict({"zero_shard": 8})


LLAMA7B_PARAMS = 6_738_415_616  # docs/profile.md, tested in tests/test_profile.py
LLAMA7B_MAX_UNIT = 32000 * 4096  # the largest parameter group: embedding (= head) matrix, 131,072,000
A100_80GB = 85_899_345_920


def test_llama7b_adamw_on_one_a100_80gb_is_infeasible_with_every_term():
    s = static_memory(LLAMA7B_PARAMS, LLAMA7B_MAX_UNIT, TrainingConfig(), "bf16")
    assert s.total_bytes == 16 * LLAMA7B_PARAMS  # 107.8 GB, no sharding
    cap = DeviceCapacity(A100_80GB, 1 << 30, s)
    assert not cap.fits and cap.activation_capacity_bytes == A100_80GB - (1 << 30) - 16 * LLAMA7B_PARAMS
    suggestion = smallest_fitting_shards(LLAMA7B_PARAMS, LLAMA7B_MAX_UNIT, TrainingConfig(), "bf16", A100_80GB, 1 << 30)
    assert suggestion == (3, 2)  # 8P + 2 units of 2 bytes: 54.4 GB < 84.8 GB
    reason = capacity_reason(cap, suggestion)
    for text in ("params 12.55 GiB", "grads 12.55 GiB", "master 25.10 GiB", "optimizer_state 50.21 GiB",
                 "100.41 GiB static", "80.00 GiB of device memory", "training.zero_shards=2"):
        assert text in reason, (text, reason)
    # At stage 1: 4P + 12P/N + reserve < device first holds at N = 2 (26.95 + 40.43 + 1.07 = 68.5 GB).
    stage1 = TrainingConfig(zero_stage=1)
    assert smallest_fitting_shards(LLAMA7B_PARAMS, LLAMA7B_MAX_UNIT, stage1, "bf16", A100_80GB, 1 << 30) == (1, 2)
    # Stage 1 with the fp32 gradient buffer and a 40 GB device: 6P = 40.4 GB alone: only stage 3 fits.
    fp32_grads = TrainingConfig(zero_stage=1, grad_buffers="fp32")
    assert smallest_fitting_shards(LLAMA7B_PARAMS, LLAMA7B_MAX_UNIT, fp32_grads, "bf16", 40 * 10**9, 1 << 30) == (3, 4)
    # With 8 shards (stage 3) it fits: 16P/8 + two gathered units of 2 bytes per parameter.
    eight = static_memory(LLAMA7B_PARAMS, LLAMA7B_MAX_UNIT, TrainingConfig(zero_shards=8), "bf16")
    assert eight.total_bytes == 16 * (LLAMA7B_PARAMS // 8) + 4 * LLAMA7B_MAX_UNIT
    assert DeviceCapacity(A100_80GB, 1 << 30, eight).fits
