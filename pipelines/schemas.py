"""Structured-config schemas: Hydra validates every composed config against these at compose time.

The root `SlackSwapConfig` is stored in Hydra's ConfigStore as `slackswap_schema` and is the first
entry of `conf/config.yaml`'s defaults list, so every group preset is merged into a typed node:

- a typo (`model.num_layer=3`) fails with "Key 'num_layer' not in 'ModelSchema'";
- a wrong type (`model.num_layers=three`) fails with "Value 'three' ... could not be converted to Integer";
- an unknown preset (`model=gpt5`) fails with Hydra's "Could not find 'model/gpt5'" plus the options.

`ModelSchema`, `MoESchema`, `MLASchema`, `HardwareSchema`, `HostLinkSchema` and `NodeSchema` mirror the library
dataclasses field for field (tests/test_config.py keeps them from drifting); `ModelSchema.torch` is the one extra
node, mirrored by `slackswap.profile.torch.spec.TorchSpec`. Range checks (positive bandwidth, budget in
(0, 1]) stay in the library (`from_dict` -> `ConfigError`), so a script and Hydra reject the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pipelines import hydra_versions

#: Repository root (the folder holding conf/ and pipelines/). The default MLflow store lives here, so
#: runs land in one database whatever the working directory.
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class TorchSchema:
    """Mirrors `slackswap.profile.torch.spec.TorchSpec`: present on a model preset, the graph is traced
    from a real PyTorch model (docs/torch_profile.md) instead of built analytically."""

    builder: str = MISSING
    attention: str = "eager"
    semantics: str = "cuda"
    hook: str = ""
    config_class: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    kernels: str = "eager"


@dataclass
class MoESchema:
    """Mirrors `slackswap.moe_config.MoEConfig`: the experts of an MoE model (`model.moe`)."""

    num_experts: int = MISSING
    top_k: int = MISSING
    expert_ffn_hidden_size: int = MISSING
    capacity_factor: float = 0.0
    load_percentile: float = 99.0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    score_function: str = "softmax"


@dataclass
class MLASchema:
    """Mirrors `slackswap.mla_config.MLAConfig`: multi-head latent attention (`model.mla`)."""

    q_lora_rank: int = MISSING
    kv_lora_rank: int = MISSING
    qk_nope_head_dim: int = MISSING
    qk_rope_head_dim: int = MISSING
    v_head_dim: int = MISSING


@dataclass
class ModelSchema:
    name: str = MISSING
    family: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    ffn_hidden_size: int = MISSING
    seq_len: int = MISSING
    micro_batch_size: int = MISSING
    vocab_size: int = MISSING
    dtype: str = "bf16"
    dropout: bool = True
    attention: str = "eager"
    include_optimizer: bool = False
    source: str = ""
    attention_kernel: str = ""
    #: None: a dense model.
    moe: MoESchema | None = None
    #: 0: hidden_size / num_heads.
    head_dim: int = 0
    #: None: multi-head (or grouped-query) attention.
    mla: MLASchema | None = None
    #: Not a `ModelConfig` field: the torch profile source's settings (None: the analytic graph).
    torch: TorchSchema | None = None


@dataclass
class HostLinkSchema:
    name: str = MISSING
    d2h_theoretical_bytes_per_s: float = MISSING
    h2d_theoretical_bytes_per_s: float = MISSING
    d2h_effective_bytes_per_s: float = MISSING
    h2d_effective_bytes_per_s: float = MISSING
    latency_s: float = MISSING
    d2h_engines: int = 1
    h2d_engines: int = 1
    d2h_setup_s: float = 0.0


@dataclass
class HardwareSchema:
    name: str = MISSING
    peak_flops_per_s: dict[str, float] = MISSING
    hbm_bytes_per_s: float = MISSING
    device_memory_bytes: int = MISSING
    link: HostLinkSchema = MISSING
    efficiency: dict[str, float] = MISSING
    hbm_efficiency: float = MISSING
    launch_overhead_s: float = MISSING
    source: str = ""
    sku: str = ""
    attention_kernels: dict[str, float] = field(default_factory=dict)
    # Compute lost per second of overlapped FSDP collective (slackswap.hardware.Hardware); 0 = none.
    collective_overlap_slowdown: float = 0.0
    # GPU idle seconds per all-gather FSDP1's rate limiter holds (slackswap.hardware.Hardware); 0 = none.
    rate_limited_all_gather_s: float = 0.0
    # Hockney's n_1/2 per op class in FLOPs (slackswap.hardware.Hardware); absent = the plain roofline.
    half_performance_flops: dict[str, float] = field(default_factory=dict)


@dataclass
class NodeSchema:
    """Mirrors `slackswap.node.Node`: the server around the GPU (conf/node, docs/hardware.md)."""

    name: str = MISSING
    gpus_per_node: int = MISSING
    gpus_per_pcie_switch: int = MISSING
    switch_uplink_h2d_bytes_per_s: float | None = MISSING
    switch_uplink_d2h_bytes_per_s: float | None = MISSING
    h2d_duplex_fraction: float = MISSING
    d2h_duplex_fraction: float = MISSING
    numa_nodes: int = MISSING
    host_dram_bytes_per_numa_s: float | None = MISSING
    pinned_host_bytes: int = MISSING
    pin_setup_s_per_tensor: float = 0.0
    nic_placement: str = "none"
    nics_per_node: int = 0
    nic_bytes_per_s: float = 0.0
    nic_latency_s: float = 0.0
    network_busbw_bytes_per_s: float | None = None
    nic_uplink_fraction: float = 0.0
    nvlink_bytes_per_s: float = 0.0
    nvlink_latency_s: float = 0.0
    source: str = ""


@dataclass
class ParallelSchema:
    """Mirrors `slackswap.parallel.ParallelConfig`: the layout whose one rank's graph a run builds
    (conf/parallel documents each field; the defaults are one full replica)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    microbatches: int = 1
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1


@dataclass
class ProfileSchema:
    """Where the op graph comes from: a `slackswap.profile.sources` name plus its keyword options. A
    model preset's `torch` node selects the `torch` source instead (docs/pipeline.md)."""

    source: str = MISSING
    options: dict[str, Any] = field(default_factory=dict)
    #: Op durations: "roofline" (the graph's own, `slackswap.profile.timing`) or "measured" (every op of
    #: the captured step timed on the device, `pipelines.train` only; docs/profile.md "Measured op times").
    timing: str = "roofline"
    #: Where measured op-time tables are cached (one file per graph, device and versions); "" : none.
    cache_dir: str = "${repo_root:}/outputs/op_times"
    #: Measured timing: steps run before timing, then steps timed (each op keeps its median and spread).
    warmup: int = 2
    repeats: int = 5
    #: A measured machine description (`python -m pipelines.measure_links`); null: the CPU's links are
    #: measured at the start of a measured run (docs/profile.md "Measured links").
    machine: str | None = None


@dataclass
class PlannerSchema:
    """A planner preset: a registry name plus free-form keyword options for its constructor."""

    name: str = MISSING
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class BudgetSchema:
    """Exactly one of the two must be set (checked by `slackswap.budget.Budget`)."""

    fraction: float | None = None
    bytes: int | None = None
    device: bool = False
    reserve_bytes: int = 1 << 30


@dataclass
class TrainingSchema:
    """The training recipe (`slackswap.memory.recipe.TrainingConfig`): static memory per GPU."""

    optimizer: str = "adamw"
    precision: str = "mixed"
    grad_buffers: str = "param"
    zero_stage: int = 3
    zero_shards: int = 1
    #: Transformer Engine-style FP8 copies of the transformer layers' linear inputs (docs/profile.md).
    fp8_linear_inputs: bool = False
    #: fully_shard (FSDP2) or FullyShardedDataParallel (FSDP1 with its rate limiter; docs/advise.md).
    fsdp_api: str = "fully_shard"


@dataclass
class SimulateSchema:
    """Simulator options that do not change the plan (`allocator`) and how planners meet the budget.

    - allocator: none (byte-exact, as before) or caching (replay through PyTorch's caching allocator
      model: peak_reserved_bytes, fragmentation_share, fits_reserved).
    - plan_against: allocated (plan for the budget as given) or reserved (replan with a smaller budget
      until the caching allocator's reserved memory fits the budget; needs allocator=caching).
    - plan_margin_fraction: the planner sees budget x (1 - margin), keeping that share free.
    """

    allocator: str = "none"
    plan_against: str = "allocated"
    plan_margin_fraction: float = 0.0


@dataclass
class TrackingSchema:
    """Where MLflow runs go. `uri` is any MLflow tracking URI (sqlite file or http server)."""

    enabled: bool = True
    uri: str = MISSING
    experiment: str = "slackswap"
    #: Used only when this run creates the experiment. null: the tracking server decides.
    artifact_location: str | None = None


@dataclass
class ExperimentSchema:
    """Metadata of a named experiment (`+experiment=paper`); an ad-hoc run keeps the defaults."""

    name: str = "adhoc"
    description: str = ""
    #: Throughput retained reported by the source, per model preset name (paper experiment only).
    paper_reference: dict[str, float] = field(default_factory=dict)
    #: The planner whose results are compared with `paper_reference`.
    paper_planner: str = "slackswap"
    paper_source: str = ""
    #: No published figures: the sweep writes and prints workload_table.md instead (one row per workload,
    #: every planner beside `paper_planner` with its gap to the milp bound; pipelines/modern_table.py).
    workload_table: bool = False


@dataclass
class IdentifySchema:
    """`+experiment=seed_identify` (pipelines/identify.py, slackswap/experiment/identify.py): the shared-assumption
    grid. `models` holds the model presets (placed by the experiment's defaults list)."""

    models: dict[str, ModelSchema] = field(default_factory=dict)
    reference: dict[str, float] = field(default_factory=dict)
    tolerance_pp: float = 0.3
    budget_fraction: float = 0.5
    planner: str = "slackswap"
    bound_planner: str = "milp"
    #: How many of the best settings get the bound planner's certified gap.
    bound_points: int = 3
    workers: int = 2
    refine_within_pp: float = 1.5
    coarse: dict[str, list[Any]] = field(default_factory=dict)
    fine: dict[str, list[Any]] = field(default_factory=dict)
    #: Each knob's plausible range and where it comes from (printed with the result).
    ranges: dict[str, str] = field(default_factory=dict)


@dataclass
class SlackSwapConfig:
    model: ModelSchema = MISSING
    hardware: HardwareSchema = MISSING
    node: NodeSchema = MISSING
    profile: ProfileSchema = MISSING
    planner: PlannerSchema = MISSING
    budget: BudgetSchema = MISSING
    training: TrainingSchema = MISSING
    tracking: TrackingSchema = MISSING
    simulate: SimulateSchema = field(default_factory=SimulateSchema)
    #: conf/parallel; a default so that a root without the group (advise) keeps one full replica.
    parallel: ParallelSchema = field(default_factory=ParallelSchema)
    experiment: ExperimentSchema = field(default_factory=ExperimentSchema)
    #: Set by `+experiment=seed_identify`: the run evaluates the shared-assumption grid instead.
    identify: IdentifySchema | None = None
    #: Which figures to draw (docs/pipeline.md, "Plots"): "all" (every run's timeline.png and the sweep
    #: plots), "summary" (only the sweep plots), "none", or "auto": all for a single run, summary for
    #: the jobs of a sweep (a timeline costs more than a fast job's own work).
    plots: str = "auto"


@dataclass
class TrainSchema:
    """`python -m pipelines.train`: real optimizer steps under the plan (slackswap.runtime)."""

    steps: int = 3
    device: str = "cpu"
    seed: int = 0
    lr: float = 1.0e-4
    #: "eager": slackswap's own runtime (apply); "compile": the plan exported to PyTorch's selective
    #: checkpointing, each layer torch.compile'd (slackswap.runtime.export).
    executor: str = "eager"
    #: Keep the host allocator's freed memory in the process (glibc's trim and mmap thresholds), as a
    #: GPU's caching allocator does, so that no step pays page faults at random
    #: (slackswap.profile.host_allocator); false: the C library's own behaviour.
    keep_freed_host_memory: bool = True


@dataclass
class SlackSwapTrainConfig(SlackSwapConfig):
    train: TrainSchema = field(default_factory=TrainSchema)


def register() -> None:
    """Store the root schemas and the `repo_root` resolver. Idempotent (tests import this repeatedly)."""
    ConfigStore.instance().store(name="slackswap_schema", node=SlackSwapConfig)
    ConfigStore.instance().store(name="slackswap_train_schema", node=SlackSwapTrainConfig)
    hydra_versions.register_resolver("repo_root", lambda: str(REPO_ROOT))
    hydra_versions.trust_own_callbacks()


register()
