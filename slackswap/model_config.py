"""Transformer shape and training settings: everything the profile needs to build the op graph."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slackswap import validation as check
from slackswap.errors import ConfigError, reject_unknown_fields
from slackswap.hardware import ATTENTION_KERNEL_NAMES, DTYPES
from slackswap.mla_config import MLAConfig
from slackswap.moe_config import MoEConfig

FAMILIES: tuple[str, ...] = ("bert", "gpt2", "llama")
ATTENTION_KERNELS: tuple[str, ...] = ("eager", "flash")
BYTES_PER_ELEMENT: Mapping[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelConfig:
    """One transformer training workload (shape + micro-batch + numerics)."""

    name: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    seq_len: int
    micro_batch_size: int
    vocab_size: int
    dtype: str = "bf16"
    dropout: bool = True
    attention: str = "eager"
    include_optimizer: bool = False
    source: str = ""
    #: The attention kernel that runs `attention` ("": not named, the preset's one attention
    #: efficiency): "eager" for eager attention, a fused kernel (flash1, flash2, flash3, triton,
    #: cudnn) for flash. It changes the timing only (`Hardware.attention_kernels`), never the graph.
    attention_kernel: str = ""
    #: Mixture-of-experts MLP in every layer (`slackswap.moe_config`); None: a dense model.
    moe: MoEConfig | None = None
    #: Width of one attention head (query, key and value); 0: hidden_size / num_heads, the usual tie.
    #: Qwen3 sets it apart (head_dim 128 with hidden 2048 and 32 heads); llama family only.
    head_dim: int = 0
    #: Multi-head latent attention in every layer (`slackswap.mla_config`); None: multi-head / grouped-query.
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        if self.moe is not None and not isinstance(self.moe, MoEConfig):  # a `moe:` block, or a graph's meta
            object.__setattr__(self, "moe", MoEConfig.from_dict(self.moe))
        if self.mla is not None and not isinstance(self.mla, MLAConfig):
            object.__setattr__(self, "mla", MLAConfig.from_dict(self.mla))
        if self.moe is not None and self.family != "llama":
            raise ConfigError("model.family", self.family, "model.moe (experts) is modelled for the llama family only")
        if self.family not in FAMILIES:
            raise ConfigError("model.family", self.family, f"unknown family; known: {FAMILIES}")
        if self.dtype not in DTYPES:
            raise ConfigError("model.dtype", self.dtype, f"unknown dtype; known: {DTYPES}")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError("model.attention", self.attention, f"unknown kernel; known: {ATTENTION_KERNELS}")
        if self.attention_kernel and self.attention_kernel not in ATTENTION_KERNEL_NAMES:
            raise ConfigError("model.attention_kernel", self.attention_kernel,
                              f"unknown kernel; known: {ATTENTION_KERNEL_NAMES}")
        if self.attention_kernel and (self.attention_kernel == "eager") != (self.attention == "eager"):
            raise ConfigError("model.attention_kernel", self.attention_kernel,
                              f"does not run model.attention={self.attention!r} (eager runs eager, the rest flash)")
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "seq_len",
            "micro_batch_size",
            "vocab_size",
        ):
            check.integer(f"model.{name}", getattr(self, name), 1)
        self._check_attention_shape()
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "model.num_kv_heads", self.num_kv_heads, f"does not divide model.num_heads={self.num_heads}"
            )

    def _check_attention_shape(self) -> None:
        """head_dim and MLA: one ConfigError naming the field. (`moe.first_dense_layers` may exceed the
        layers, as HF's `first_k_dense_replace` may: a cut of the model is then all dense.)"""
        check.integer("model.head_dim", self.head_dim, 0)
        if self.head_dim and self.family != "llama":
            raise ConfigError("model.head_dim", self.head_dim, "is modelled for the llama family only")
        if self.mla is not None:
            if self.family != "llama":
                raise ConfigError("model.family", self.family, "model.mla (latent attention) is modelled for the "
                                  "llama family only")
            if self.head_dim:
                raise ConfigError("model.head_dim", self.head_dim, "is not used under model.mla (its head widths "
                                  "are model.mla.qk_nope_head_dim + qk_rope_head_dim and v_head_dim); set 0")
            if self.num_kv_heads != self.num_heads:
                raise ConfigError("model.num_kv_heads", self.num_kv_heads, f"must equal model.num_heads="
                                  f"{self.num_heads} under model.mla (every head up-projects its own key and value)")
        if not self.head_dim and self.mla is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                "model.hidden_size", self.hidden_size, f"is not divisible by model.num_heads={self.num_heads}"
            )

    @property
    def attention_head_dim(self) -> int:
        """One head's query/key/value width: `head_dim`, or hidden_size / num_heads when it is 0."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_width(self) -> int:
        """Width of all heads' queries (and of the attention context): num_heads x head width."""
        return self.num_heads * self.attention_head_dim

    @property
    def bytes_per_element(self) -> int:
        return BYTES_PER_ELEMENT[self.dtype]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        data = dict(data)
        reject_unknown_fields("model", data, cls.__dataclass_fields__)
        return cls(**data)
