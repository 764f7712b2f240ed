"""Every metric of metrics.json, declared once: its name, unit, meaning and kind.

The names are the stage contract (docs/contract.md); this table is where they live. Each builder of
metrics.json checks the keys it built against it (`slackswap.simulate.metrics`, the allocator replay,
`slackswap.experiment.run`), the sweep summary takes its columns from it (`pipelines/aggregate.py`),
the run record reads its text metrics from it (`pipelines/records.py`), MLflow's run description
gives its units (`pipelines/presentation.py`), and docs/contract.md's table of metrics is rendered
from it (`python -m slackswap.metrics_table` prints the block; `tests/test_metrics_table.py` checks
the doc holds exactly that). A new metric is one `MetricSpec` here plus its computation.

Groups say which builder makes a metric and when a run has it: `simulation`, `static` and `run` in
every metrics.json; `allocator` when the caching allocator is modelled; `traced` when the graph is
traced from a real model; `node` when the run is on a node (conf/node); `layout` when the run is one
rank of a parallel layout (conf/parallel, not `none`); `pipeline` when that layout has pipeline
stages (parallel.pp > 1; per-stage figures are comma-separated, stage 0 first). A run has all of a group's
metrics or none (unknown values are None, never absent).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from slackswap.errors import ConfigError

#: Kinds of value: a number (int or float), a boolean, or text. Any metric may also be None (null).
KINDS = ("number", "bool", "text")
#: Groups of metrics in the order a metrics.json is built; the first three are in every run.
GROUPS = ("simulation", "static", "run", "allocator", "traced", "node", "layout", "pipeline")
ALWAYS = ("simulation", "static", "run")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    #: `s`, `bytes`, `ratio` (a fraction, 1 = 100 %), `count`, `FLOP`, `tokens`, `tokens/s`, `GB/s`
    #: (1e9 bytes per second), `bool` or `text`.
    unit: str
    description: str
    kind: str = "number"
    group: str = "run"
    #: In docs/contract.md's "at least" list: kept whatever else changes.
    contract: bool = False
    #: A column of the sweep summary (summary.csv, `pipelines/aggregate.py`).
    summary: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"metrics.{self.name}.kind", self.kind, f"must be one of {list(KINDS)}")
        if self.group not in GROUPS:
            raise ConfigError(f"metrics.{self.name}.group", self.group, f"must be one of {list(GROUPS)}")


def _sim(name: str, unit: str, description: str, kind: str = "number", **flags: bool) -> MetricSpec:
    return MetricSpec(name, unit, description, kind, "simulation", **flags)


_C = {"contract": True, "summary": True}
_S = {"summary": True}

METRICS: tuple[MetricSpec, ...] = (
    # The simulation (slackswap.simulate.metrics); the contract's list first, in its order.
    _sim("throughput_ratio", "ratio", "throughput retained: ideal step time / simulated step time", **_C),
    _sim("step_s", "s", "simulated step time under the plan", **_C),
    _sim("ideal_step_s", "s", "step time of keep-all with no memory limit", **_C),
    _sim("peak_activation_bytes", "bytes", "activation peak reached in this run", **_C),
    _sim("keep_all_peak_bytes", "bytes", "activation peak of keep-all with no limit", **_C),
    _sim("budget_bytes", "bytes", "the activation budget the plan must meet", **_C),
    _sim("recompute_s", "s", "compute time spent recomputing", **_C),
    _sim("stall_s", "s", "time compute waited (prefetch or memory)", **_C),
    _sim("d2h_bytes", "bytes", "bytes offloaded device to host", **_C),
    _sim("h2d_bytes", "bytes", "bytes prefetched host to device", **_C),
    _sim("swapped_tensors", "count", "tensors the plan swaps", **_C),
    _sim("recomputed_tensors", "count", "tensors the plan recomputes", **_C),
    _sim("plan_wall_s", "s", "wall-clock time of planning on this machine", **_C),
    _sim("sim_wall_s", "s", "wall-clock time of the simulation on this machine", **_C),
    _sim("feasible", "bool", "the plan was simulated within its budget", "bool", **_C),
    _sim("infeasible_reason", "text", "why the run is infeasible (null when feasible)", "text"),
    _sim("min_feasible_bytes", "bytes", "least budget the planner plans within (planner-infeasible runs)"),
    _sim("host_peak_bytes", "bytes", "most host bytes live at once (host copies: offload to last prefetch)"),
    _sim("host_pinned_bytes", "bytes", "pinned host bytes the runtime holds for the plan (a buffer per offload)"),
    _sim("stall_prefetch_s", "s", "stall waiting for a prefetch"),
    _sim("stall_memory_s", "s", "stall waiting for memory to be freed"),
    _sim("stall_offload_s", "s", "stall waiting for an offload a tool's offloader runs on the compute stream"),
    _sim("pin_s", "s", "host time pinning memory per offload (a tool's offloader)"),
    _sim("compute_busy_s", "s", "time the compute stream is busy"),
    _sim("d2h_busy_s", "s", "time the device-to-host engine is busy"),
    _sim("h2d_busy_s", "s", "time the host-to-device engine is busy"),
    _sim("bound_step_s", "s", "the planner's lower bound on step time (null without one)", **_S),
    _sim("optimality_gap", "ratio", "step_s / bound_step_s - 1"),
    # The device's static split (slackswap.experiment.run, slackswap.memory.static).
    MetricSpec("static_bytes", "bytes", "static training state per GPU, all terms", group="static", **_S),
    MetricSpec("static_params_bytes", "bytes", "parameters per GPU", group="static"),
    MetricSpec("static_grads_bytes", "bytes", "gradients per GPU", group="static"),
    MetricSpec("static_master_bytes", "bytes", "fp32 master weights per GPU", group="static"),
    MetricSpec("static_optimizer_state_bytes", "bytes", "optimizer state per GPU", group="static"),
    MetricSpec("static_gathered_params_bytes", "bytes", "parameters gathered at once (ZeRO-3)", group="static"),
    MetricSpec("num_params", "count", "model parameters", group="static"),
    MetricSpec("device_memory_bytes", "bytes", "the device's memory", group="static"),
    MetricSpec("reserve_bytes", "bytes", "memory held back (context, workspace)", group="static"),
    MetricSpec("activation_capacity_bytes", "bytes", "device memory - reserve - static", group="static"),
    # The run's verdicts (slackswap.experiment.run).
    MetricSpec("headroom_bytes", "bytes", "activation capacity left at the device peak", **_S),
    MetricSpec("device_peak_activation_bytes", "bytes", "peak the device sees (reserved when modelled)"),
    # The caching allocator's replay (slackswap.memory.allocator_replay), when modelled.
    MetricSpec("peak_reserved_bytes", "bytes", "allocator's reserved peak", group="allocator", **_S),
    MetricSpec("peak_block_bytes", "bytes", "allocated blocks' peak after rounding", group="allocator"),
    MetricSpec("fragmentation_share", "ratio", "share of the reserved peak no live tensor uses",
               group="allocator", **_S),
    MetricSpec("fits_reserved", "bool", "the reserved peak fits the budget", "bool", "allocator", **_S),
    MetricSpec("allocator_oom_reason", "text", "why the allocator ran out (null if it did not)", "text",
               "allocator"),
    MetricSpec("allocator_segments", "count", "cudaMalloc calls with no capacity limit", group="allocator"),
    # Speed and the device verdict (slackswap.experiment.run, slackswap.experiment.throughput).
    MetricSpec("tokens_per_s", "tokens/s", "tokens per second per GPU", **_S),
    MetricSpec("mfu", "ratio", "model FLOPs utilisation", **_S),
    MetricSpec("fits_device", "bool", "peak + static + reserve fit the device (null: not judged)", "bool", **_S),
    MetricSpec("planning_budget_bytes", "bytes", "budget the planner was given (fitting may lower it)"),
    MetricSpec("planning_rounds", "count", "plan-and-simulate rounds of the fitting"),
    MetricSpec("model_flops", "FLOP", "model FLOPs of one step"),
    MetricSpec("model_flops_source", "text", "where model_flops comes from", "text"),
    MetricSpec("tokens_per_step", "tokens", "tokens of one step per GPU"),
    MetricSpec("ideal_tokens_per_s", "tokens/s", "tokens per second of the ideal step"),
    MetricSpec("ideal_mfu", "ratio", "model FLOPs utilisation of the ideal step"),
    # A traced graph against the analytic graph of the same shape.
    MetricSpec("analytic_keep_all_peak_bytes", "bytes", "keep-all peak of the analytic graph", group="traced"),
    MetricSpec("real_to_analytic_peak_ratio", "ratio", "traced keep-all peak / analytic one", group="traced"),
    # The node (conf/node): what each GPU's host link really gave (slackswap.sharing).
    MetricSpec("node", "text", "the node preset", "text", "node", summary=True),
    MetricSpec("gpus_per_node", "count", "GPUs of the node", group="node", **_S),
    MetricSpec("effective_h2d_gbps", "GB/s", "host-to-device rate one GPU gets", group="node", **_S),
    MetricSpec("effective_d2h_gbps", "GB/s", "device-to-host rate one GPU gets", group="node", **_S),
    MetricSpec("h2d_limit", "text", "what limits host-to-device", "text", "node", summary=True),
    MetricSpec("d2h_limit", "text", "what limits device-to-host", "text", "node"),
    MetricSpec("sharing_gpus", "count", "GPUs sharing one switch uplink", group="node"),
    MetricSpec("pinned_host_bytes", "bytes", "the node's pinned host memory", group="node"),
    MetricSpec("pinned_needed_bytes", "bytes", "pinned host bytes the node's ranks need (host_pinned_bytes x GPUs)",
               group="node"),
    MetricSpec("alone_throughput_ratio", "ratio", "throughput retained with the GPU alone on its link",
               group="node", **_S),
    # One rank of a parallel layout (slackswap.experiment.run.layout_metrics, slackswap.profile.collectives).
    # In the sweep summary: a workload table names each row's layout from them (pipelines/modern_table.py).
    *(MetricSpec(f"parallel_{k}", "count", f"the layout's {k} degree", group="layout", **_S)
      for k in ("dp", "tp", "pp", "cp", "ep")),
    MetricSpec("parallel_sp", "bool", "Megatron sequence parallelism on", "bool", "layout", **_S),
    MetricSpec("parallel_world_size", "count", "GPUs of the layout (dp x tp x pp x cp)", group="layout"),
    MetricSpec("rank_layer_saved_bytes", "bytes", "largest per-layer saved bytes on this rank", group="layout"),
    MetricSpec("layout_collectives", "count", "collectives the layout adds inside the step", group="layout"),
    MetricSpec("layout_comm_bus_bytes", "bytes", "bytes those collectives put on the bus", group="layout"),
    MetricSpec("layout_comm_forward_s", "s", "their ring time in forward", group="layout"),
    MetricSpec("layout_comm_backward_s", "s", "their ring time in backward", group="layout"),
    MetricSpec("layout_comm_s", "s", "the part of that time the step waits on, per micro-batch (in step_s; "
               "a pipeline's in each stage's forward and backward, stage 0's here; null when unpriced)",
               group="layout"),
    MetricSpec("layout_comm_hidden_s", "s", "the part hidden behind attention compute (context-parallel rings)",
               group="layout"),
    MetricSpec("layout_comm_fabric", "text", "the fabric each group's ring runs on", "text", "layout"),
    MetricSpec("layout_comm_unpriced", "text", "why their time is not priced (null when priced)", "text", "layout"),
    # A pipeline layout (slackswap.experiment.pipeline_run, slackswap.simulate.pipeline).
    MetricSpec("pipeline_schedule", "text", "the stages' micro-batch order (1f1b, interleaved or zb_h1)", "text",
               "pipeline"),
    MetricSpec("pipeline_microbatches", "count", "micro-batches per step through the pipeline", group="pipeline"),
    MetricSpec("pipeline_virtual_stages", "count", "model chunks per device (interleaved; 1 under 1F1B)",
               group="pipeline"),
    MetricSpec("pipeline_bubble_fraction", "ratio", "stages' idle share of the planned pipeline step",
               group="pipeline", summary=True),
    MetricSpec("pipeline_ideal_bubble_fraction", "ratio", "stages' idle share of the keep-all pipeline step",
               group="pipeline"),
    MetricSpec("pipeline_p2p_s", "s", "one boundary activation's send to the next stage", group="pipeline"),
    MetricSpec("pipeline_p2p_unpriced", "text", "why sends cost 0 s (null when priced)", "text", "pipeline"),
    MetricSpec("pipeline_in_flight_by_stage", "text",
               "micro-batches each stage holds at most (1F1B: p - i; interleaved: chunks)", "text", "pipeline"),
    MetricSpec("pipeline_budget_bytes_by_stage", "text", "each stage's activation budget", "text", "pipeline"),
    MetricSpec("pipeline_peak_bytes_by_stage", "text", "each stage's activation peak with its micro-batches in flight",
               "text", "pipeline"),
    MetricSpec("pipeline_keep_all_peak_bytes_by_stage", "text", "each stage's keep-all peak with its micro-batches "
               "in flight", "text", "pipeline"),
    MetricSpec("pipeline_forward_s_by_stage", "text", "each stage's planned forward of one micro-batch", "text",
               "pipeline"),
    MetricSpec("pipeline_backward_s_by_stage", "text", "each stage's planned backward of one micro-batch", "text",
               "pipeline"),
    MetricSpec("pipeline_static_bytes_by_stage", "text", "each stage's static training state per GPU", "text",
               "pipeline"),
    MetricSpec("pipeline_bound_s_by_stage", "text", "each stage's lower bound on one micro-batch's forward + "
               "backward under its budget, any plan (the milp's; null without a bound)", "text", "pipeline"),
)


def by_name(metrics: Iterable[MetricSpec] | None = None) -> dict[str, MetricSpec]:
    return {m.name: m for m in (METRICS if metrics is None else metrics)}


def names(group: str | None = None, *, contract: bool = False, summary: bool = False,
          kind: str | None = None) -> tuple[str, ...]:
    """The table's names in order, filtered: one group, the contract's, the summary's, one kind."""
    return tuple(
        m.name for m in METRICS
        if (group is None or m.group == group) and (not contract or m.contract)
        and (not summary or m.summary) and (kind is None or m.kind == kind)
    )


def check_group(metrics: Mapping[str, object], group: str) -> None:
    """A builder's keys are exactly its group's names: one that is missing or not declared is a
    ConfigError naming it (a metric added to a builder but not to the table, or the reverse)."""
    _check_keys(set(metrics), set(names(group)), f"metrics ({group})")


def check_metrics(metrics: Mapping[str, object]) -> None:
    """A whole metrics.json: every key declared, the groups in every run present, and each group
    present whole."""
    declared = by_name()
    unknown = sorted(set(metrics) - set(declared))
    if unknown:
        raise ConfigError("metrics", unknown, "not declared in slackswap.metrics_table.METRICS")
    present = {declared[k].group for k in metrics} | set(ALWAYS)
    expected = {m.name for m in METRICS if m.group in present}
    _check_keys(set(metrics), expected, "metrics")


def _check_keys(got: set[str], expected: set[str], where: str) -> None:
    if got - expected:
        raise ConfigError(where, sorted(got - expected), "not declared in slackswap.metrics_table.METRICS")
    if expected - got:
        raise ConfigError(where, sorted(expected - got), "declared but not built")


def units_by_unit(present: Iterable[str]) -> dict[str, list[str]]:
    """{unit: [names]} for the declared names of `present`, units in first-seen table order."""
    wanted = set(present)
    out: dict[str, list[str]] = {}
    for m in METRICS:
        if m.name in wanted:
            out.setdefault(m.unit, []).append(m.name)
    return out


TABLE_BEGIN = "<!-- metrics table: begin (generated by `python -m slackswap.metrics_table`; checked by a test) -->"
TABLE_END = "<!-- metrics table: end -->"


def markdown() -> str:
    """docs/contract.md's table of every metric, between its markers."""
    rows = [f"| `{m.name}` | {m.unit} | {m.kind} | {m.group} | {m.description} |" for m in METRICS]
    head = ["| metric | unit | kind | group | meaning |", "|---|---|---|---|---|"]
    return "\n".join([TABLE_BEGIN, *head, *rows, TABLE_END]) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
