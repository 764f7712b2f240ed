"""Static memory per GPU: parameters, gradients and optimizer state, and what is left for activations.

Every byte count cites its source (docs/memory.md has the table):

- Mixed-precision Adam holds 2 bytes of 16-bit parameters, 2 bytes of 16-bit gradients and K = 12
  bytes of optimizer state per parameter (fp32 master weights, momentum, variance): 2 + 2 + 12 = 16
  (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  section 3.1).
- ZeRO stage 1 (P_os) divides the optimizer state by the data-parallel degree N, stage 2 (P_os+g)
  also the gradients, stage 3 (P_os+g+p) also the parameters (ZeRO section 5.1 and Figure 1:
  7.5 B parameters, N = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB).
- An fp32 gradient buffer (Megatron-LM's `main_grad`) makes bf16 + Adam 2 + 4 + 12 = 18 bytes per
  parameter, fp32 training 4 + 4 + 8 = 16 (Megatron-LM docs, distributed optimizer, "bytes per
  parameter" table).
- Pure 16-bit training keeps Adam's two moments in the 16-bit dtype and no master copy: 2 + 2 + 4.
- Plain SGD (PyTorch's `torch.optim.SGD`, default momentum 0) keeps no state; mixed precision still
  keeps the 4-byte fp32 master weights.
- Stage 3 gathers one sharding unit's full parameters for its forward and backward, and FSDP's default
  `backward_prefetch=BACKWARD_PRE` gathers the next unit while the current one runs: two units of
  full 16-bit parameters live at once (PyTorch FSDP docs, `BackwardPrefetch`). The unit is the
  largest parameter group of the graph (one transformer layer, or embeddings + head).

Not counted: communication buckets (DDP/ZeRO reduce buckets), the CUDA context and library
workspaces (those are the configurable `reserve_bytes` of the device budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slackswap.errors import ConfigError
from slackswap.memory.recipe import TrainingConfig

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class StaticMemory:
    """Static bytes on one GPU, term by term (each already divided by the shards that hold it)."""

    num_params: int
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    gathered_params_bytes: int
    training: TrainingConfig

    @property
    def total_bytes(self) -> int:
        return (
            self.params_bytes
            + self.grads_bytes
            + self.master_bytes
            + self.optimizer_state_bytes
            + self.gathered_params_bytes
        )

    def terms(self) -> dict[str, int]:
        """The named terms, for metrics and reasons (`static_<name>` in metrics.json)."""
        return {
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "master_bytes": self.master_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "gathered_params_bytes": self.gathered_params_bytes,
        }

    def describe(self) -> str:
        t = self.training
        sharding = f"ZeRO stage {t.zero_stage} over {t.zero_shards} GPU(s)"
        parts = ", ".join(f"{name.removesuffix('_bytes')} {_gb(v)}" for name, v in self.terms().items() if v)
        return (
            f"{t.optimizer} {t.precision} ({sharding}), {self.num_params:,} parameters: "
            f"{parts} = {_gb(self.total_bytes)} static per GPU"
        )


def _gb(n: int) -> str:
    """GiB, the unit of every byte count printed on stdout (pipelines/presentation.py)."""
    return f"{n / 2**30:.2f} GiB"


def bytes_per_param(training: TrainingConfig, model_dtype: str) -> tuple[int, int, int, int]:
    """(parameter, gradient, master copy, optimizer state) bytes per parameter, before sharding."""
    training.check_model_dtype(model_dtype)
    param = _BYTES[model_dtype]
    grad = 4 if training.grad_buffers == "fp32" else param
    master = 4 if training.precision == "mixed" else 0
    state_dtype_bytes = 2 if training.precision == "pure16" else 4
    moments = 2 if training.optimizer == "adamw" else 0
    return param, grad, master, moments * state_dtype_bytes


def _sharded(num: int, bytes_each: int, shards: int, sharded: bool) -> int:
    """ZeRO partitions the flat parameter vector evenly, padding the last shard: ceil(P / N) each."""
    return bytes_each * (math.ceil(num / shards) if sharded else num)


def static_memory(
    num_params: int, max_unit_params: int, training: TrainingConfig, model_dtype: str
) -> StaticMemory:
    """Static bytes on one data-parallel GPU. `max_unit_params`: the largest parameter group (layer)."""
    if num_params <= 0:
        raise ConfigError("num_params", num_params, "must be positive")
    if not 0 < max_unit_params <= num_params:
        raise ConfigError("max_unit_params", max_unit_params, f"must be in (0, num_params={num_params}]")
    param, grad, master, state = bytes_per_param(training, model_dtype)
    n, stage = training.zero_shards, training.zero_stage
    gathered = 2 * max_unit_params * param if stage == 3 and n > 1 else 0
    return StaticMemory(
        num_params=num_params,
        params_bytes=_sharded(num_params, param, n, stage >= 3),
        grads_bytes=_sharded(num_params, grad, n, stage >= 2),
        master_bytes=_sharded(num_params, master, n, stage >= 1),
        optimizer_state_bytes=_sharded(num_params, state, n, stage >= 1),
        gathered_params_bytes=gathered,
        training=training,
    )


def optimizer_step_bytes_per_param(training: TrainingConfig, model_dtype: str) -> int:
    """HBM bytes the optimizer update streams per parameter it updates (it is bandwidth-bound).

    Reads the gradient; reads and writes the master weights and every state tensor; writes the 16-bit
    parameters from the master copy, or reads and writes the parameters when there is no master
    copy. Mixed AdamW: 2 + 2*4 + 2*8 + 2 = 28 bytes; fp32 AdamW: 4 + 2*8 + 2*4 = 28.
    """
    param, grad, master, state = bytes_per_param(training, model_dtype)
    weights = 2 * master + param if master else 2 * param
    return grad + weights + 2 * state


def optimizer_step_moved_bytes(unit_params: int, training: TrainingConfig, model_dtype: str) -> int:
    """Bytes one rank's optimizer update moves for one parameter group: it updates its 1/N shard once
    the optimizer state is sharded (stage >= 1)."""
    updated = math.ceil(unit_params / training.zero_shards) if training.zero_stage >= 1 else unit_params
    return updated * optimizer_step_bytes_per_param(training, model_dtype)


@dataclass(frozen=True)
class DeviceCapacity:
    """Device memory split into static, reserve and what is left for activations (may be negative)."""

    device_memory_bytes: int
    reserve_bytes: int
    static: StaticMemory

    @property
    def activation_capacity_bytes(self) -> int:
        return self.device_memory_bytes - self.reserve_bytes - self.static.total_bytes

    @property
    def fits(self) -> bool:
        return self.activation_capacity_bytes > 0


def smallest_fitting_shards(
    num_params: int,
    max_unit_params: int,
    training: TrainingConfig,
    model_dtype: str,
    device_memory_bytes: int,
    reserve_bytes: int,
    *,
    max_shards: int = 1 << 16,
) -> tuple[int, int] | None:
    """(zero_stage, zero_shards): the smallest N at the configured stage (or at stage 3 if that stage
    can never fit) that leaves room for activations; None if even stage 3 at `max_shards` does not."""
    stages = [training.zero_stage] if training.zero_stage == 3 else [max(training.zero_stage, 1), 3]
    for stage in stages:
        def room(n: int, stage: int = stage) -> int:
            t = TrainingConfig(training.optimizer, training.precision, training.grad_buffers, stage, n)
            static = static_memory(num_params, max_unit_params, t, model_dtype)
            return device_memory_bytes - reserve_bytes - static.total_bytes

        if room(max_shards) <= 0:
            continue
        lo, hi = 1, max_shards  # room(n) grows with n (apart from the gathered term, which is constant for n > 1)
        if room(lo) > 0:
            return stage, lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if room(mid) > 0:
                hi = mid
            else:
                lo = mid
        return stage, hi
    return None


def capacity_reason(capacity: DeviceCapacity, suggestion: tuple[int, int] | None) -> str:
    """Why static memory alone does not fit, term by term, and the sharding that would."""
    s = capacity.static
    lines = [
        f"static memory does not fit: {s.describe()}; with a reserve of {_gb(capacity.reserve_bytes)} "
        f"that is {_gb(s.total_bytes + capacity.reserve_bytes)} against {_gb(capacity.device_memory_bytes)} "
        f"of device memory ({_gb(-capacity.activation_capacity_bytes)} over, before any activation)"
    ]
    if suggestion is None:
        lines.append("no ZeRO sharding up to 65536 GPUs fits")
    else:
        stage, shards = suggestion
        lines.append(f"smallest sharding that fits: training.zero_stage={stage} training.zero_shards={shards}")
    return "; ".join(lines)
