"""What the torch profile source builds: a `TorchSpec` (torch-free, so configs validate without torch).

The shape (layers, hidden, heads, FFN, vocabulary), sequence length, micro-batch and dtype come from the
model's `ModelConfig` (the same keys as an analytic preset, so every CLI override works for both
sources and the analytic graph of the same shape is at hand for comparison); `TorchSpec` adds which
builder makes the `nn.Module`, the attention implementation, the kernel semantics and the builder's
extra config keys (dropout probabilities, activation, norm epsilon: the published config values).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slackswap.errors import ConfigError, reject_unknown_fields

BUILDERS: tuple[str, ...] = ("hf_bert", "hf_gpt2", "hf_llama", "tiny_gpt", "hook", "hf")
ATTENTION_IMPLS: tuple[str, ...] = ("eager", "sdpa")
SEMANTICS: tuple[str, ...] = ("cuda", "cpu")
#: How the traced step's elementwise ops are priced (`slackswap.profile.torch.fusion`): each aten call
#: its own kernel, as eager PyTorch runs them, or each run of them one fused kernel, as the analytic
#: graph and the calibrated presets count them.
KERNEL_MODES: tuple[str, ...] = ("eager", "fused")


@dataclass(frozen=True)
class TorchSpec:
    builder: str
    attention: str = "eager"
    semantics: str = "cuda"
    #: `package.module:function` for `builder: hook` (see docs/torch_profile.md), else empty.
    hook: str = ""
    #: A `transformers` config class by name (`Qwen3Config`, `MixtralConfig`...) for `builder: hf`, else empty.
    config_class: str = ""
    #: Extra keyword arguments of the builder (HF config keys for the hf_* builders).
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: `eager` or `fused` (KERNEL_MODES): the timing only, never the graph's tensors.
    kernels: str = "eager"

    def __post_init__(self) -> None:
        if self.builder not in BUILDERS:
            raise ConfigError("model.torch.builder", self.builder, f"unknown builder; known: {BUILDERS}")
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError("model.torch.attention", self.attention,
                              f"unknown attention implementation; known: {ATTENTION_IMPLS}")
        if self.semantics not in SEMANTICS:
            raise ConfigError("model.torch.semantics", self.semantics, f"unknown kernel semantics; known: {SEMANTICS}")
        if self.kernels not in KERNEL_MODES:
            raise ConfigError("model.torch.kernels", self.kernels, f"unknown kernel mode; known: {KERNEL_MODES}")
        if (self.builder == "hook") != bool(self.hook):
            raise ConfigError("model.torch.hook", self.hook, "is required for builder 'hook' and only for it")
        if (self.builder == "hf") != bool(self.config_class):
            raise ConfigError("model.torch.config_class", self.config_class,
                              "is required for builder 'hf' and only for it")
        if self.hook and (self.hook.count(":") != 1 or not all(self.hook.split(":"))):
            raise ConfigError("model.torch.hook", self.hook, "must be 'package.module:function'")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TorchSpec:
        data = dict(data)
        reject_unknown_fields("model.torch", data, cls.__dataclass_fields__)
        data["extra"] = dict(data.get("extra") or {})
        return cls(**data)
