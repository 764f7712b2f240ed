"""The training recipe that decides the static memory per GPU: optimizer, precision, gradient buffers, ZeRO.

Validated here, in the library, so Hydra and a script reject the same values (`ConfigError` naming the
field). The byte counts each choice implies are in `slackswap.memory.static`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slackswap import validation as check
from slackswap.errors import ConfigError, reject_unknown_fields

OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")
#: mixed: 16-bit parameters and gradients with fp32 master weights (Micikevicius et al. 2018; ZeRO's
#: "mixed precision training" of section 3.1). pure16: parameters, gradients and optimizer state all in
#: the model's 16-bit dtype, no master copy. fp32: everything in fp32.
PRECISIONS: tuple[str, ...] = ("mixed", "pure16", "fp32")
#: param: gradients in the parameters' dtype (PyTorch's `param.grad`). fp32: an fp32 gradient
#: accumulation buffer (Megatron-LM's `main_grad`, `--accumulate-allreduce-grads-in-fp32`).
GRAD_BUFFERS: tuple[str, ...] = ("param", "fp32")
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
#: PyTorch's two FSDP APIs. fully_shard: FSDP2 (torch.distributed.fsdp.fully_shard; torchtitan), whose
#: streams wait on each other. FullyShardedDataParallel: FSDP1 with its default limit_all_gathers=True
#: (PyTorch >= 2.1, pytorch/pytorch#104900; Composer / llm-foundry and fms-fsdp run it), whose rate
#: limiter blocks the CPU thread before an all-gather ("does not require blocking the CPU like in FSDP1's
#: limit_all_gathers=True", the fully_shard docs).
FSDP2, FSDP1 = "fully_shard", "FullyShardedDataParallel"
FSDP_APIS: tuple[str, ...] = (FSDP2, FSDP1)


@dataclass(frozen=True)
class TrainingConfig:
    """How one data-parallel rank holds the model's training state.

    `zero_stage` (Rajbhandari et al. 2020, ZeRO, section 5): 1 shards the optimizer state, 2 also the
    gradients, 3 also the parameters, each over `zero_shards` data-parallel GPUs. The default stage 3
    is PyTorch FSDP's default `ShardingStrategy.FULL_SHARD`; with `zero_shards=1` nothing is sharded.
    """

    optimizer: str = "adamw"
    precision: str = "mixed"
    grad_buffers: str = "param"
    zero_stage: int = 3
    zero_shards: int = 1
    #: Keep the saved input of every transformer-layer linear in FP8 (1 byte per element) instead of the
    #: model dtype, as NVIDIA Transformer Engine's FP8 `Linear` / `LayerNormLinear` / `LayerNormMLP` do
    #: (they save the FP8 cast of the input for the weight-gradient GEMM; TE docs, "Using FP8 with
    #: Transformer Engine"). The analytic profile only (`slackswap.profile.layers`); off by default.
    fp8_linear_inputs: bool = False
    #: Which FSDP API shards at stage 3 (`FSDP_APIS`): with FullyShardedDataParallel each all-gather its
    #: rate limiter holds costs `Hardware.rate_limited_all_gather_s` (`slackswap.communication`).
    fsdp_api: str = FSDP2

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("training.optimizer", self.optimizer, f"unknown optimizer; known: {OPTIMIZERS}")
        if self.precision not in PRECISIONS:
            raise ConfigError("training.precision", self.precision, f"unknown recipe; known: {PRECISIONS}")
        if self.grad_buffers not in GRAD_BUFFERS:
            raise ConfigError("training.grad_buffers", self.grad_buffers, f"unknown; known: {GRAD_BUFFERS}")
        stage = self.zero_stage
        if not isinstance(stage, int) or isinstance(stage, bool) or stage not in ZERO_STAGES:
            raise ConfigError("training.zero_stage", self.zero_stage, f"must be one of {ZERO_STAGES}")
        check.integer("training.zero_shards", self.zero_shards, 1)
        if not isinstance(self.fp8_linear_inputs, bool):
            raise ConfigError("training.fp8_linear_inputs", self.fp8_linear_inputs, "must be true or false")
        if self.fsdp_api not in FSDP_APIS:
            raise ConfigError("training.fsdp_api", self.fsdp_api, f"unknown FSDP API; known: {FSDP_APIS}")

    def check_model_dtype(self, model_dtype: str) -> None:
        """The recipe and the model's activation dtype must agree (fp32 recipe <=> fp32 model)."""
        if (self.precision == "fp32") != (model_dtype == "fp32"):
            raise ConfigError(
                "training.precision",
                self.precision,
                f"does not match model.dtype={model_dtype!r} (fp32 recipe needs an fp32 model; "
                "mixed and pure16 need a 16-bit model)",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingConfig:
        data = dict(data)
        reject_unknown_fields("training", data, cls.__dataclass_fields__)
        return cls(**data)
