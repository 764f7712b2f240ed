"""The records of the advise search (`experiment.advise`): what is searched (`SearchSpace`, `Layout`),
a configuration (`Candidate`), its priced row (`Row`), a rejected region (`Region`) and the answer
(`Advice`), with the reasons a region is rejected."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from slackswap import validation as check
from slackswap.communication import StepCommunication, not_modelled
from slackswap.errors import ConfigError
from slackswap.memory.recipe import TrainingConfig
from slackswap.parallel import ParallelConfig

PLAN_AGAINST = ("allocated", "reserved")
#: Rejected-region reasons (advice.json `rejected_regions[].reason`).
STATIC_DOES_NOT_FIT = "static memory does not fit"
ACTIVATIONS_DO_NOT_FIT = "activations do not fit"
COMMUNICATION_BOUND = "communication bound"
RECIPE_DOES_NOT_APPLY = "recipe does not apply"
LAYOUT_DOES_NOT_DIVIDE = "layout does not divide the model"
#: Layouts (tp x pp x cp > 1) whose optimistic throughput could not beat the best already planned, or
#: beyond `SearchSpace.layout_top_n` (`experiment.advise_layout`).
NOT_PLANNED = "not planned: cannot beat the best"
#: A configuration whose exposed communication takes at least this share of its step is flagged
#: communication bound (and a layout all of whose fitting rows are, is a rejected region).
COMMUNICATION_BOUND_SHARE = 0.25


@dataclass(frozen=True)
class SearchSpace:
    """What the advise searches. Every list is tried exhaustively, up to the pruning rules."""

    gpus: tuple[int, ...]
    #: Recipe name -> its optimizer / precision / gradient buffers (the ZeRO fields are searched).
    recipes: Mapping[str, TrainingConfig]
    micro_batches: tuple[int, ...]
    #: Planner name -> options. "milp" is run on the best `milp_top_k` configurations only.
    planners: Mapping[str, Mapping[str, Any]]
    plan_against: tuple[str, ...] = PLAN_AGAINST
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    grad_accum: int = 1
    milp_top_k: int = 3
    reserve_bytes: int = 1 << 30
    #: Headroom every answer leaves: peak (static + reserve + reserved activations + communication
    #: buffers) <= device memory - margin (conf/advise.yaml gives the default and its rationale).
    margin_bytes: int = 0
    #: Layout degrees searched besides data parallelism (`experiment.advise_layout`); (1,) each: none.
    tp: tuple[int, ...] = (1,)
    pp: tuple[int, ...] = (1,)
    cp: tuple[int, ...] = (1,)
    #: Expert-parallel degrees searched on an MoE model (`parallel.ep`: dividing its experts and
    #: dp x cp); a dense model is searched with ep 1 only.
    ep: tuple[int, ...] = (1,)
    #: Megatron sequence parallelism on every tp > 1 layout.
    sp: bool = True
    #: Micro-batches per pipeline step of a pp > 1 layout (`parallel.microbatches`).
    pipeline_microbatches: tuple[int, ...] = (8,)
    #: Pipeline schedules searched on a pp > 1 layout (a name or a list: `1f1b`, `interleaved`):
    #: 1f1b is one chunk per device; interleaved (Megatron's virtual pipeline) each of `virtual_stages`.
    pipeline_schedule: tuple[str, ...] | str = ("1f1b",)
    #: Model chunks per device searched under the interleaved schedule (each >= 2; Megatron's
    #: virtual pipeline size): layers divisible by pp x v, micro-batches a multiple of pp.
    virtual_stages: tuple[int, ...] = (2,)
    #: At most this many layout configurations are planned, best optimistic estimate first.
    layout_top_n: int = 40
    #: Workers the evaluations spread over (joblib's `n_jobs`: -1 every core) and the joblib backend
    #: (`loky` local processes; `dask` / `ray` reach a cluster; None: the caller's
    #: `joblib.parallel_config`). The answer is the same whatever the count (`experiment.parallel_map`).
    n_jobs: int = 1
    backend: str | None = "loky"

    def __post_init__(self) -> None:
        def positive_ints(name: str, values: Sequence[int]) -> None:
            if not values:
                raise ConfigError(f"advise.{name}", list(values), "must list at least one value")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ConfigError(f"advise.{name}", list(values), f"{v!r} is not an integer >= 1")

        positive_ints("gpus", self.gpus)
        positive_ints("micro_batches", self.micro_batches)
        if list(self.micro_batches) != sorted(set(self.micro_batches)):
            raise ConfigError("advise.micro_batches", list(self.micro_batches), "must be strictly increasing")
        if not self.recipes:
            raise ConfigError("advise.recipes", [], "must list at least one training recipe")
        if not self.planners:
            raise ConfigError("advise.planners", [], "must list at least one planner")
        if set(self.planners) == {"milp"}:
            raise ConfigError("advise.planners", ["milp"], "milp refines the best configurations of the other "
                              "planners: list at least one more")
        for against in self.plan_against:
            if against not in PLAN_AGAINST:
                raise ConfigError("advise.plan_against", list(self.plan_against), f"{against!r} not in {PLAN_AGAINST}")
        if not self.plan_against:
            raise ConfigError("advise.plan_against", [], f"must list some of {PLAN_AGAINST}")
        for stage in self.zero_stages:
            if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
                raise ConfigError("advise.zero_stages", list(self.zero_stages), f"{stage!r} not in 0..3")
        if not self.zero_stages:
            raise ConfigError("advise.zero_stages", [], "must list at least one ZeRO stage")
        check.integer("advise.grad_accum", self.grad_accum, 1)
        check.integer("advise.milp_top_k", self.milp_top_k, 0)
        check.integer("budget.reserve_bytes", self.reserve_bytes, 0)
        check.integer("advise.margin_bytes", self.margin_bytes, 0)
        for name in ("tp", "pp", "cp", "ep", "pipeline_microbatches", "virtual_stages"):
            positive_ints(name, getattr(self, name))
            if list(getattr(self, name)) != sorted(set(getattr(self, name))):
                raise ConfigError(f"advise.{name}", list(getattr(self, name)), "must be strictly increasing")
        for v in self.virtual_stages:
            if v < 2:
                raise ConfigError("advise.virtual_stages", list(self.virtual_stages),
                                  f"{v} is not an integer >= 2 (chunks per device under the interleaved schedule; "
                                  "one chunk is 1f1b: list it in advise.pipeline_schedule)")
        check.flag("advise.sp", self.sp)
        object.__setattr__(self, "pipeline_schedule", _schedules(self.pipeline_schedule))
        check.integer("advise.layout_top_n", self.layout_top_n, 1)
        from slackswap.experiment.parallel_map import check_n_jobs

        check_n_jobs("advise.n_jobs", self.n_jobs)
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise ConfigError("advise.backend", self.backend, "must name a joblib backend (loky, dask, ray, ...)")

    @property
    def searches_layouts(self) -> bool:
        return (self.tp, self.pp, self.cp, self.ep) != ((1,), (1,), (1,), (1,))

    def pipeline_variants(self) -> list[tuple[str, int]]:
        """The (schedule, chunks per device) a pp > 1 layout is searched under: (1f1b, 1), then
        (interleaved, v) for each of `virtual_stages`, then (zb_h1, 1), as `pipeline_schedule` lists them."""
        out = [("1f1b", 1)] if "1f1b" in self.pipeline_schedule else []
        if "interleaved" in self.pipeline_schedule:
            out += [("interleaved", v) for v in self.virtual_stages]
        if "zb_h1" in self.pipeline_schedule:
            out.append(("zb_h1", 1))
        return out


def _schedules(value: Any) -> tuple[str, ...]:
    """`advise.pipeline_schedule` as a tuple: one schedule name or a list of distinct ones."""
    from slackswap.parallel import PIPELINE_SCHEDULES

    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Sequence) else None
    if not names or len(set(names)) != len(names) or any(n not in PIPELINE_SCHEDULES for n in names):
        shown = list(names) if names is not None and not isinstance(value, str) else value
        raise ConfigError("advise.pipeline_schedule", shown,
                          f"must be one of {list(PIPELINE_SCHEDULES)} or a list of distinct ones")
    return names


@dataclass(frozen=True)
class Layout:
    """How `gpus` GPUs split the model (tp x pp x cp, `slackswap.parallel`) and hold the training state
    (ZeRO stage and shards) over the dp x cp ranks that hold the same dense parameters, dp = gpus /
    (tp pp cp) data-parallel replicas times the cp ranks (`ParallelConfig.dp_cp`)."""

    gpus: int
    zero_stage: int
    zero_shards: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False
    #: Micro-batches per pipeline step (pp > 1), else 1.
    microbatches: int = 1
    schedule: str = "1f1b"
    #: Model chunks per device (interleaved: Megatron's virtual pipeline size), 1 under 1F1B.
    virtual_stages: int = 1
    #: Expert-parallel ranks (an MoE model's experts split over them, carved out of dp x cp).
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def parallel(self) -> ParallelConfig:
        """The `parallel` of this layout: what `pipelines.run` takes to run the same layout."""
        return ParallelConfig(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, sp=self.sp,
                              microbatches=self.microbatches if self.pp > 1 else 1,
                              pipeline_schedule=self.schedule, virtual_stages=self.virtual_stages)

    @property
    def expert_shards(self) -> int:
        """GPUs the expert parameters' ZeRO state is sharded over: the expert data-parallel group,
        dp x cp / ep (`slackswap.profile.stages.expert_shards`); the dense parameters' is zero_shards,
        dp x cp (`ParallelConfig.dp_cp`)."""
        from slackswap.profile.stages import expert_shards

        return expert_shards(self.parallel, self.zero_stage, self.zero_shards)

    @property
    def is_data_parallel(self) -> bool:
        return self.tp == self.pp == self.cp == self.ep == 1

    @property
    def label(self) -> str:
        if not self.is_data_parallel:
            zero = "" if self.parallel.dp_cp == 1 else " DDP" if self.zero_stage == 0 else f" ZeRO-{self.zero_stage}"
            chunks = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            pipe = f" pp{self.pp} x {self.microbatches} mb {self.schedule}{chunks}" if self.pp > 1 else ""
            return (f"{self.gpus} GPUs dp{self.dp} tp{self.tp}{'+sp' if self.sp else ''}{pipe}"
                    f"{f' cp{self.cp}' if self.cp > 1 else ''}{f' ep{self.ep}' if self.ep > 1 else ''}{zero}")
        if self.gpus == 1:
            return "1 GPU"
        if self.zero_stage == 0:
            return f"{self.gpus} GPUs DDP"
        if self.zero_stage == 3 and self.zero_shards < self.gpus:
            return f"{self.gpus} GPUs ZeRO-3 HSDP x{self.zero_shards}"
        return f"{self.gpus} GPUs ZeRO-{self.zero_stage}"


def layouts(gpus: int, stages: Sequence[int], gpus_per_node: int) -> list[Layout]:
    """The layouts of `gpus` GPUs: one on a single GPU (nothing to shard: every stage is the same);
    else DDP (stage 0), stages 1 / 2 over all GPUs, stage 3 over all GPUs and, when the job spans
    nodes, FSDP's HYBRID_SHARD: stage 3 within each node, replicated across nodes (the layout HSDP is
    for: gathers on NVLink, only the gradient all-reduce on the network)."""
    if gpus == 1:
        return [Layout(1, 0, 1)]
    out = []
    for stage in stages:
        if stage == 0:
            out.append(Layout(gpus, 0, 1))
        elif stage in (1, 2):
            out.append(Layout(gpus, stage, gpus))
        else:
            out.append(Layout(gpus, 3, gpus))
            if 1 < gpus_per_node < gpus and gpus % gpus_per_node == 0:
                out.append(Layout(gpus, 3, gpus_per_node))
    return out


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    recipe: str
    training: TrainingConfig
    micro_batch: int
    planner: str
    plan_against: str

    def choices(self) -> dict[str, Any]:
        return {
            "gpus": self.layout.gpus,
            "zero_stage": self.layout.zero_stage,
            "zero_shards": self.layout.zero_shards,
            "layout": self.layout.label,
            "dp": self.layout.dp,
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "cp": self.layout.cp,
            "ep": self.layout.ep,
            "sp": self.layout.sp,
            "pipeline_microbatches": self.layout.microbatches,
            "pipeline_schedule": self.layout.schedule,
            "virtual_stages": self.layout.virtual_stages,
            "recipe": self.recipe,
            "micro_batch": self.micro_batch,
            "planner": self.planner,
            "plan_against": self.plan_against,
        }


@dataclass(frozen=True)
class Row:
    """One evaluated configuration (advice.json `rows[]`)."""

    candidate: Candidate
    status: str  # "ok" | "infeasible"
    reason: str
    fits_device: bool
    tokens_per_s: float | None
    mfu: float | None
    step_s: float | None
    micro_step_s: float | None
    optimizer_s: float
    comm: StepCommunication | None
    comm_exposed_s: float | None
    peak_bytes: int | None
    headroom_bytes: int | None
    static_bytes: int
    activation_capacity_bytes: int
    peak_activation_bytes: int | None
    peak_reserved_bytes: int | None
    swapped: int | None
    recomputed: int | None
    recompute_s: float | None
    stall_s: float | None
    model_flops_per_step: float
    bound: str = ""
    why: str = ""
    #: How the recipe changes the training's numerics against mixed-precision AdamW ("" none:
    #: `numerics_change`).
    numerics: str = ""
    #: Per pipeline stage (one for pp = 1) of a layout row: planner, budget, peak (`StagePlan`).
    stages: tuple[StagePlan, ...] = ()
    #: Seconds per step of the layout's tp / cp collectives on the critical path (layout rows).
    layout_comm_s: float | None = None
    #: Communication buffers counted in the peak (bytes), and what the layout leaves out.
    comm_buffer_bytes: int = 0
    layout_note: str = ""
    #: What the communication model leaves out on this row's hardware (`communication.not_modelled`).
    comm_not_modelled: str = not_modelled(0.0)

    def to_json(self) -> dict[str, Any]:
        c = self.comm
        return {
            **self.candidate.choices(),
            "status": self.status,
            "reason": self.reason,
            "fits_device": self.fits_device,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "step_s": self.step_s,
            "micro_step_s": self.micro_step_s,
            "optimizer_s": self.optimizer_s,
            "comm_total_s": None if c is None else c.total_comm_s,
            "comm_exposed_s": self.comm_exposed_s,
            "comm_fabric": None if c is None else c.fabric,
            "comm_replica_fabric": None if c is None else c.replica_fabric,
            "comm_assumption": None if c is None else c.assumption,
            "comm_not_modelled": self.comm_not_modelled,
            "peak_bytes": self.peak_bytes,
            "headroom_bytes": self.headroom_bytes,
            "static_bytes": self.static_bytes,
            "activation_capacity_bytes": self.activation_capacity_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "swapped_tensors": self.swapped,
            "recomputed_tensors": self.recomputed,
            "recompute_s": self.recompute_s,
            "stall_s": self.stall_s,
            "model_flops_per_step": self.model_flops_per_step,
            "bound": self.bound,
            "why": self.why,
            "numerics": self.numerics,
            "stages": [asdict(p) for p in self.stages],
            "layout_comm_s": self.layout_comm_s,
            "comm_buffer_bytes": self.comm_buffer_bytes,
            "layout_note": self.layout_note,
        }


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's plan in a layout row."""

    #: The device (pipeline stage) index.
    stage: int
    planner: str
    #: Micro-batches (interleaved: micro-batch chunks) the device holds at most.
    in_flight: int
    budget_bytes: int
    #: Static + reserve + communication buffers + the stage's activation peak with `in_flight`
    #: micro-batches (reserved estimate), bytes on the device.
    peak_bytes: int
    static_bytes: int
    #: One micro-batch's forward and backward seconds on the device (interleaved: over its chunks).
    forward_s: float
    backward_s: float
    #: The model chunks the device holds (`profile.stages`: chunk c on device c mod pp), () for none.
    chunks: tuple[int, ...] = ()


def numerics_change(training: TrainingConfig) -> str:
    """How `training` changes what the training computes against mixed-precision AdamW (fp32 master
    weights and moments, 16-bit compute; Micikevicius et al. 2018), "" when it does not: an answer may
    prefer such a recipe only saying so beside it."""
    out = []
    if training.precision == "pure16":
        out.append("16-bit parameters and AdamW moments, no fp32 master copy (updates below the 16-bit "
                   "spacing are lost)")
    if training.optimizer != "adamw":
        out.append(f"optimizer {training.optimizer} instead of AdamW")
    if training.fp8_linear_inputs:
        out.append("FP8 saved linear inputs")
    return "; ".join(out)


@dataclass(frozen=True)
class Region:
    """Configurations rejected together, before or after planning, and why."""

    reason: str
    detail: str
    choices: Mapping[str, Any]
    configurations: int

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "detail": self.detail, "configurations": self.configurations,
                **dict(self.choices)}


@dataclass(frozen=True)
class Advice:
    rows: tuple[Row, ...]
    regions: tuple[Region, ...]
    #: GPU count -> index into `rows` of the fastest fitting configuration (absent: none fits).
    best: Mapping[int, int]
    ranked: tuple[int, ...]
    pruned_configurations: int
    #: GPU count -> the fastest fitting row whose recipe keeps the numerics (`numerics_change` "").
    best_faithful: Mapping[int, int] = field(default_factory=dict)

    def best_rows(self) -> dict[int, Row]:
        return {g: self.rows[i] for g, i in self.best.items()}


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other beats on memory (lower) and throughput (higher), memory ascending."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front
