"""A parallel layout: how one training job's model and data are split over GPUs (the `parallel` group).

`ParallelConfig(dp, tp, pp, cp, ep, sp)` names the layout; the default (every degree 1, sp off) is one
full replica, the graph every run built before layouts existed. The profile builds ONE RANK's graph
under a layout (`slackswap.profile.build_graph(..., parallel=...)`, docs/profile.md "Per-rank graphs"):

- **tp** (tensor parallelism, Megatron-LM, Shoeybi et al. 2019): the QKV and first MLP GEMMs are
  column-parallel, the attention projection and second MLP GEMM row-parallel, so the attention heads
  and the MLP's inner width are split over tp ranks; the LayerNorm, dropout and residual activations
  stay whole on every rank. Forward and backward each all-reduce the layer's activations twice.
- **sp** (sequence parallelism, Korthikanti et al. 2022, section 4.2.2): with tp, the LayerNorm /
  dropout / residual region is split along the sequence over the same tp ranks; each all-reduce
  becomes a reduce-scatter plus an all-gather (same bytes), and backward re-gathers the saved
  sequence shard of each column-parallel GEMM's input. sp with tp=1 splits nothing (Megatron turns it
  off); it is accepted and changes nothing.
- **cp** (context parallelism, Megatron-Core / ring attention, Liu et al. 2023): every rank holds s/cp
  of the sequence for the whole layer; attention exchanges K and V around a ring of cp ranks.
- **pp** (pipeline parallelism): layers split into pp stages (interleaved: pp x virtual_stages chunks,
  v per device), each one rank's graph of its layers (`slackswap.profile.stages`); the step runs
  `microbatches` micro-batches through them in the `pipeline_schedule` order
  (`slackswap.pipeline_stages`, `slackswap.simulate.pipeline`; docs/pipeline_parallel.md).
- **ep** (expert parallelism, GShard / Megatron-Core): an MoE model's experts split over ep ranks,
  each holding num_experts / ep experts and the tokens dispatched to them; all-to-all dispatch and
  combine (`slackswap.profile.moe`). ep must divide the experts and dp * cp; a dense model has ep 1.
- **dp** (data parallelism): replicas of the rest; it does not change a rank's activations.
  The cp ranks hold the same dense parameters as the dp replicas, so the dense gradients are reduced,
  and ZeRO / FSDP shards the dense state, over the dp x cp ranks (`ParallelConfig.dp_cp`): Megatron-Core
  allocates the dense gradient buffers on `get_data_parallel_group(with_context_parallel=True)`
  (NVIDIA/Megatron-LM/megatron/core/distributed/distributed_data_parallel.py) and torchtitan shards
  FSDP over its `dp_shard_cp` mesh (pytorch/torchtitan/torchtitan/distributed/parallel_dims.py); the
  routed experts over their expert data-parallel group of dp x cp / ep. Those collectives are priced
  by `slackswap.communication.step_communication` (advise).

World size = dp * tp * pp * cp (ep is carved out of dp * cp in Megatron-Core, not a factor of it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from slackswap.errors import ConfigError, reject_unknown_fields
from slackswap.model_config import ModelConfig
from slackswap.pipeline_stages import check_interleaved

DEGREES: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep")
#: Pipeline schedules the step model runs (`slackswap.simulate.pipeline`).
PIPELINE_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zb_h1")
#: The fields that only a pipeline (pp > 1) reads; a one-stage layout's `as_dict` leaves them out
#: (and a 1F1B one `virtual_stages`, so its dict is what it was before interleaving existed).
PIPELINE_FIELDS: tuple[str, ...] = ("microbatches", "pipeline_schedule", "virtual_stages")


@dataclass(frozen=True)
class ParallelConfig:
    """One rank's place in a parallel layout. Every degree >= 1; the defaults are one full replica."""

    #: Data-parallel replicas (ZeRO / FSDP shard within them: conf/training).
    dp: int = 1
    #: Tensor-parallel ranks (Megatron column/row-parallel linears).
    tp: int = 1
    #: Pipeline stages.
    pp: int = 1
    #: Context-parallel ranks (the sequence split for the whole layer; ring attention).
    cp: int = 1
    #: Expert-parallel ranks (MoE experts, out of dp * cp; must be 1 for a dense model).
    ep: int = 1
    #: Megatron sequence parallelism: shard the LayerNorm/dropout/residual activations by tp.
    sp: bool = False
    #: Micro-batches per step through the pipeline (each of model.micro_batch_size); 1 without one.
    microbatches: int = 1
    #: The order each stage runs its micro-batches: `1f1b` (PipeDream-Flush, Megatron-LM's default) or
    #: `interleaved` (interleaved 1F1B, Megatron-LM's virtual pipeline) or `zb_h1` (zero bubble ZB-H1,
    #: Qi et al. 2024: the weight gradients fill the cool-down bubble; docs/pipeline_parallel.md).
    pipeline_schedule: str = "1f1b"
    #: Model chunks per pipeline device under `interleaved` (Megatron's virtual pipeline size, >= 2);
    #: 1 under 1F1B. The layers split into pp x virtual_stages chunks.
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name in DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"parallel.{name}", value, "must be an integer >= 1")
        if not isinstance(self.sp, bool):
            raise ConfigError("parallel.sp", self.sp, "must be true or false")
        m = self.microbatches
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ConfigError("parallel.microbatches", m, "must be an integer >= 1")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError("parallel.pipeline_schedule", self.pipeline_schedule,
                              f"must be one of {list(PIPELINE_SCHEDULES)}")
        if self.pp == 1 and m != 1:
            raise ConfigError("parallel.microbatches", m,
                              "micro-batches run through a pipeline; with parallel.pp=1 set 1")
        v = self.virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError("parallel.virtual_stages", v, "must be an integer >= 1")
        if self.pipeline_schedule == "interleaved":
            check_interleaved(self.pp, v, m)
        elif v != 1:
            raise ConfigError("parallel.virtual_stages", v, "must be 1 unless parallel.pipeline_schedule=interleaved")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ParallelConfig:
        data = dict(data or {})
        reject_unknown_fields("parallel", data, cls.__dataclass_fields__)
        return cls(**data)

    @property
    def is_replica(self) -> bool:
        """True for the default layout: one rank's graph is the whole model's (no field changes it)."""
        return self.tp == 1 and self.pp == 1 and self.cp == 1 and self.ep == 1

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same dense parameters: dp x cp (module docstring, **dp**). The dense
        gradients are reduced over them and ZeRO / FSDP shards the dense state over them."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        """GPUs the layout occupies: dp * tp * pp * cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sequence_shards(self) -> int:
        """How many ranks split the LayerNorm/dropout/residual region along the sequence (tp under sp)."""
        return self.tp if self.sp else 1

    def as_dict(self) -> dict[str, Any]:
        """The fields; a one-stage layout leaves out the pipeline's (its dict is what it always was)."""
        data = asdict(self)
        if self.pp == 1:
            for name in PIPELINE_FIELDS:
                data.pop(name)
        elif self.virtual_stages == 1:
            data.pop("virtual_stages")
        return data

    @property
    def chunks(self) -> int:
        """Model chunks the layers split into: pp x virtual_stages (pp under 1F1B)."""
        return self.pp * self.virtual_stages

    def check_model(self, model: ModelConfig) -> None:
        """Reject a layout that does not divide `model`: one ConfigError naming the field and value."""
        if model.num_heads % self.tp:
            raise ConfigError("parallel.tp", self.tp, f"does not divide model.num_heads={model.num_heads}")
        if model.num_kv_heads % self.tp:
            raise ConfigError("parallel.tp", self.tp, f"does not divide model.num_kv_heads={model.num_kv_heads}")
        if model.ffn_hidden_size % self.tp:
            raise ConfigError(
                "parallel.tp", self.tp, f"does not divide model.ffn_hidden_size={model.ffn_hidden_size}"
            )
        if model.seq_len % self.cp:
            raise ConfigError("parallel.cp", self.cp, f"does not divide model.seq_len={model.seq_len}")
        if self.sp and (model.seq_len // self.cp) % self.tp:
            raise ConfigError(
                "parallel.tp", self.tp,
                f"with parallel.sp=true must divide the sequence each rank holds, "
                f"model.seq_len / parallel.cp = {model.seq_len // self.cp}",
            )
        if self.cp > 1 and model.attention != "flash":
            raise ConfigError(
                "parallel.cp", self.cp,
                "context parallelism runs ring attention in a fused kernel; set model.attention=flash",
            )
        if model.num_layers % self.pp:
            raise ConfigError("parallel.pp", self.pp, f"does not divide model.num_layers={model.num_layers}")
        if model.num_layers % self.chunks:
            raise ConfigError("parallel.virtual_stages", self.virtual_stages,
                              f"times parallel.pp={self.pp} does not divide model.num_layers={model.num_layers}")
        self._check_experts(model)

    def _check_experts(self, model: ModelConfig) -> None:
        """ep divides the experts and dp * cp (Megatron-Core carves the ep group out of them); the
        analytic profile splits experts by ep only (no expert tensor parallelism: tp must be 1)."""
        experts = model.moe.num_experts if model.moe is not None else 0
        if not experts:
            if self.ep != 1:
                raise ConfigError("parallel.ep", self.ep,
                                  f"does not divide the experts of {model.name!r} (a dense model)")
            return
        if experts % self.ep:
            raise ConfigError("parallel.ep", self.ep, f"does not divide model.moe.num_experts={experts}")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError("parallel.ep", self.ep,
                              f"does not divide parallel.dp * parallel.cp = {self.dp * self.cp} "
                              "(the ep ranks are data/context-parallel ranks)")
        if self.tp != 1:
            raise ConfigError("parallel.tp", self.tp,
                              "expert tensor parallelism is not modelled for an MoE model; use parallel.ep")

    def check_gpus(self, gpus: int, field: str = "gpus") -> None:
        """Reject a layout whose dp * tp * pp * cp is not the GPU count given (`field` names it)."""
        if self.world_size != gpus:
            raise ConfigError(
                field, gpus,
                f"is not parallel dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {self.world_size}",
            )


#: One full replica: the layout of every run that does not choose one.
NO_PARALLELISM = ParallelConfig()
