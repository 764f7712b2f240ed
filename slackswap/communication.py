"""Collective communication of data-parallel / ZeRO training: what a step sends, and what it exposes.

Two models, each stated where it is used:

1. **Collective time: alpha-beta, ring algorithm.** A ring collective over n ranks runs n - 1 steps
   (all-gather, reduce-scatter) or 2 (n - 1) (all-reduce), each paying the per-step latency alpha,
   and moves the bus-bandwidth share of the buffer S (bytes of the full, unsharded buffer):

       all-gather, reduce-scatter:  t = (n - 1) alpha + S (n - 1) / n / B
       all-reduce:                  t = 2 (n - 1) alpha + 2 S (n - 1) / n / B

   B is the *bus bandwidth* (NVIDIA/nccl-tests/doc/PERFORMANCE.md: busbw = algbw x (n - 1) / n for
   all-gather and reduce-scatter, x 2 (n - 1) / n for all-reduce, "a number that should be
   comparable to the hardware peak bandwidth, independently of the number of ranks"). So the
   achievable busbw nccl-tests reports for a fabric is the B to use. A ring that leaves a node runs
   at the slower of the two fabrics (every ring step waits for its slowest link): the network's.
   That network busbw is the node's NICs together (one ring with every GPU of the node in it); rings
   of one collective that run at once with fewer GPUs per node each share them (`network_share`: a
   ring with m of the node's g GPUs gets m / g; HSDP's replica all-reduces on 8-GPU nodes, 1/8).

   Latency as NCCL's own tuning model prices a ring (NVIDIA/nccl src/graph/tuning.cc,
   `ncclTopoTuneModel`): a base latency per collective call plus, of its n - 1 steps over N nodes,
   n - N steps at the intra-node hop latency and N - 1 at the network hop latency (all-reduce: twice
   each). `Topology.fabric_for` gives a ring leaving the node the mean of those per-step latencies,
   so (n - 1) alpha is NCCL's sum; `Fabric.call_latency_s` is the base. The latency is paid per call:
   a buffer sent as k collectives (FSDP gathers one sharding unit at a time) pays it k times
   (`calls`), which is what makes a 512-rank ring slower than a 128-rank one at the same bytes.

2. **Which collectives a ZeRO stage issues, and how they overlap compute** (`step_communication`):

   - stage 0 (DDP): all-reduce of the gradients in backward, bucketed, overlapping backward;
   - stages 1, 2 (DeepSpeed ZeRO-1/2): reduce-scatter of the gradients overlapping backward, then
     an all-gather of the updated 16-bit parameters after the optimizer step, exposed;
   - stage 3 (FSDP FULL_SHARD): in forward an all-gather of each unit's parameters, the next unit
     prefetched under the current unit's compute; in backward an all-gather again (the parameters
     were freed after forward) and a reduce-scatter of the gradients, overlapping the next unit's
     backward;
   - stage 3 with shards < GPUs (FSDP HYBRID_SHARD): as stage 3 within a shard group, plus an
     all-reduce of the gradient shard across the replicas in backward: one ring per local rank, the
     node's rings sharing its NICs (model 1);
   - with expert parallelism, the routed experts' collectives of the same stage over their expert
     data-parallel group (`expert_step_communication`: ZeRO-3 gathers a layer's experts with it).

   Overlap, as the frameworks schedule it: the collectives of one phase run on their own stream, one
   sharding unit (a transformer layer; embeddings + head) at a time, one unit ahead of (forward
   prefetch, FSDP `forward_prefetch` / `BACKWARD_PRE`) or behind (gradient reduce-scatter after the
   unit's backward) the compute. With k equal units, phase compute P and phase communication C, the
   pipeline takes c + (k - 1) max(c, p) + p (c = C / k, p = P / k): the first unit's gather (or the
   last unit's reduce) is exposed, and a unit whose communication outlasts its compute exposes the
   difference. The exposed time is that minus P. DDP's 25 MB buckets are finer than a layer; taking
   layers as units overstates its exposed tail, a conservative choice.

   FSDP1's rate limiter (`FullyShardedDataParallel(limit_all_gathers=True)`, its default) blocks the
   CPU thread on a CUDA event before each all-gather of a strategy that frees the parameters after
   forward (FULL_SHARD, HYBRID_SHARD), so the GPU idles while the thread resumes and launches again
   (pytorch/pytorch#108234 measured 235 us of it; FSDP2's `fully_shard` waits stream on stream instead):
   `rate_limited_all_gathers` per micro-batch, each at the preset's fitted `rate_limited_all_gather_s`.

   What the overlapped collectives cost the compute beside them (NCCL's kernels take SMs and HBM
   bandwidth from the GEMMs) is one fitted rate per calibrated preset, seconds of compute per second
   overlapped (`StepCommunication.overlap_cost_s`, `Hardware.collective_overlap_slowdown`); 0 on an
   uncalibrated preset, where overlapped communication is free, and every advise row says which
   (`not_modelled`).

   Not modelled here: DDP / ZeRO bucket buffers and gradient accumulation's `no_sync` (every
   micro-batch reduces, as FSDP does by default). The collectives of tensor, context, expert and
   pipeline parallelism are priced apart (`slackswap.profile.collectives`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from slackswap import validation as check
from slackswap.errors import ConfigError


def not_modelled(collective_overlap_slowdown: float) -> str:
    """What the step-communication model leaves out, printed with every configuration it prices. On a
    preset with a fitted `Hardware.collective_overlap_slowdown` the overlapped collectives cost compute
    (`overlap_cost_s`), as one fitted rate and not a model of the NCCL kernels' contention."""
    if collective_overlap_slowdown > 0:
        return (f"compute slowed by overlapped collectives as one fitted rate ({collective_overlap_slowdown:g} s "
                "per s, hardware.collective_overlap_slowdown), not per kernel (SM/HBM contention)")
    return "compute slowed by NCCL kernels (SM/HBM contention) not modelled; overlapped collectives are free"


def rate_limited_all_gathers(fsdp1: bool, zero_stage: int, shards: int, units: int) -> int:
    """All-gathers per micro-batch that FSDP1's rate limiter holds the CPU thread on (module docstring,
    model 2): each unit's in forward and again in backward, where FSDP1 (`fsdp1`: the recipe's
    `fsdp_api` is FullyShardedDataParallel) shards at stage 3 (FULL_SHARD, or HYBRID_SHARD with shards <
    GPUs; its rate limiter runs for the strategies that free the parameters after forward); none under
    `fully_shard` or where nothing is sharded."""
    if not fsdp1 or zero_stage != 3 or shards == 1:
        return 0
    return 2 * units


@dataclass(frozen=True)
class Fabric:
    """One interconnect as a ring collective sees it: achievable bus bandwidth and per-step latency."""

    name: str
    #: Achievable bus bandwidth per GPU (what nccl-tests reports as busbw at large sizes), bytes/s.
    bus_bytes_per_s: float
    #: Latency of one ring step (alpha), seconds.
    latency_s: float
    #: Latency of one collective call, whatever the ranks (NCCL's base latency), seconds.
    call_latency_s: float = 0.0

    def __post_init__(self) -> None:
        check.positive("fabric.bus_bytes_per_s", self.bus_bytes_per_s)
        check.non_negative("fabric.latency_s", self.latency_s)
        check.non_negative("fabric.call_latency_s", self.call_latency_s)


#: NCCL's base latency of a ring collective with the Simple protocol, the one large FSDP buffers
#: use (NVIDIA/nccl src/graph/tuning.cc, `baseLat`, Ring/Simple: 8.4 us).
NCCL_RING_CALL_LATENCY_S = 8.4e-6


def _check(size_bytes: float, ranks: int, calls: int = 1) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError("ranks", ranks, "must be an integer >= 1")
    if not math.isfinite(size_bytes) or size_bytes < 0:
        raise ConfigError("size_bytes", size_bytes, "must be a non-negative finite number")
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ConfigError("calls", calls, "must be an integer >= 1")


def all_gather_s(size_bytes: float, ranks: int, fabric: Fabric, calls: int = 1) -> float:
    """Ring all-gather of a buffer of `size_bytes` in total (each rank holds size / ranks), sent as
    `calls` equal collectives, each paying the call and per-step latencies (module docstring)."""
    _check(size_bytes, ranks, calls)
    if ranks == 1:
        return 0.0
    latency = fabric.call_latency_s + (ranks - 1) * fabric.latency_s
    return calls * latency + size_bytes * (ranks - 1) / ranks / fabric.bus_bytes_per_s


def reduce_scatter_s(size_bytes: float, ranks: int, fabric: Fabric, calls: int = 1) -> float:
    """Ring reduce-scatter of a buffer of `size_bytes` (each rank keeps size / ranks, reduced)."""
    # same steps and bytes (NVIDIA/nccl-tests/doc/PERFORMANCE.md)
    return all_gather_s(size_bytes, ranks, fabric, calls)


def all_reduce_s(size_bytes: float, ranks: int, fabric: Fabric, calls: int = 1) -> float:
    """Ring all-reduce: a reduce-scatter followed by an all-gather (one call, twice the steps)."""
    _check(size_bytes, ranks, calls)
    if ranks == 1:
        return 0.0
    latency = fabric.call_latency_s + 2 * (ranks - 1) * fabric.latency_s
    return calls * latency + 2 * size_bytes * (ranks - 1) / ranks / fabric.bus_bytes_per_s


def pipelined_exposed_s(comm_s: float, compute_s: float, units: int) -> float:
    """Communication left on the critical path when k equal units overlap one unit ahead/behind.

    c + (k - 1) max(c, p) + p - P with c = C / k, p = P / k (module docstring). One unit: nothing
    overlaps, all of C is exposed.
    """
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ConfigError("units", units, "must be an integer >= 1")
    if comm_s < 0 or compute_s < 0:
        raise ConfigError("comm_s/compute_s", (comm_s, compute_s), "must be non-negative")
    c, p = comm_s / units, compute_s / units
    return c + (units - 1) * max(c, p) + p - compute_s


@dataclass(frozen=True)
class Topology:
    """Where the ranks of a data-parallel job sit: GPUs per node and the two fabrics."""

    gpus_per_node: int
    intra_node: Fabric
    #: None: the node has no network, so no job may span nodes.
    inter_node: Fabric | None

    def __post_init__(self) -> None:
        n = self.gpus_per_node
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError("node.gpus_per_node", n, "must be an integer >= 1")

    def fabric_for(self, ranks: int, stride: int = 1) -> Fabric:
        """The fabric of one ring over `ranks` ranks placed `stride` GPUs apart (consecutive ranks fill
        a node first), while every other GPU of the node runs its own ring of the same collective:
        NVLink when the group stays in one node, else the network (the ring's slowest link) at this
        ring's share of the node's NICs (`network_share`)."""
        span = (ranks - 1) * stride + 1
        if span <= self.gpus_per_node:
            return self.intra_node
        if self.inter_node is None:
            raise ConfigError(
                "advise.gpus", span, f"spans more than one node of {self.gpus_per_node} GPUs, and the node has no NIC"
            )
        # NCCL's ring latency (module docstring): of the n - 1 steps, N - 1 cross the network and the
        # rest stay on NVLink; the fabric carries their mean, so (n - 1) alpha is NCCL's sum.
        nodes = min(ranks, math.ceil(span / self.gpus_per_node))
        step = ((ranks - nodes) * self.intra_node.latency_s + (nodes - 1) * self.inter_node.latency_s) / (ranks - 1)
        bus = self.inter_node.bus_bytes_per_s * self.network_share(ranks, stride)
        return replace(self.inter_node, latency_s=step, bus_bytes_per_s=bus)

    def network_share(self, ranks: int, stride: int = 1) -> float:
        """The share of the node's network bus bandwidth one ring over `ranks` ranks `stride` GPUs apart
        gets when it leaves the node: its GPUs in one node over the node's GPUs.

        Why: `inter_node` is the busbw of one ring that spans whole nodes, every GPU of the node in it,
        which NCCL runs as one channel per NIC (`slackswap.node.Node.network_bus_bytes_per_s`; nccl-tests
        busbw, NVIDIA/nccl-tests/doc/PERFORMANCE.md), so it is the node's NICs together. A layout puts
        every GPU in one group of each kind and the groups of one kind run the same collective at the
        same time (HSDP's replica all-reduces, one per local rank; data-parallel rings under tensor
        parallelism; context- and expert-parallel groups; pipeline sends), so a node holding m GPUs of
        each ring carries gpus_per_node / m rings through the same NICs, each at m / gpus_per_node of
        them: HSDP with 8-GPU shard groups on 8-GPU nodes, 1/8. NVLink is not shared: each GPU has its
        own links to the NVSwitches, and its busbw is per GPU."""
        members = max(1, min(ranks, self.gpus_per_node // stride))
        return members / self.gpus_per_node

    def strided(self, stride: int) -> Topology:
        """The topology a ring over consecutive ranks of its own group sees when those ranks sit `stride`
        GPUs apart (data parallelism outside tensor / context parallelism): a node holds
        gpus_per_node // stride of them (at least 1) and, the node's other rings of the same kind running
        at once, that share of its network (`network_share`), so `fabric_for` on it prices as on self."""
        gpus = max(1, self.gpus_per_node // stride)
        inter = self.inter_node
        if inter is not None:
            inter = replace(inter, bus_bytes_per_s=inter.bus_bytes_per_s * gpus / self.gpus_per_node)
        return Topology(gpus, self.intra_node, inter)


@dataclass(frozen=True)
class StepCommunication:
    """One training step's collectives on one rank, and the part compute does not hide."""

    zero_stage: int
    gpus: int
    shards: int
    forward_comm_s: float
    backward_comm_s: float
    after_step_comm_s: float
    forward_exposed_s: float
    backward_exposed_s: float
    #: Bytes this rank sends and receives through collectives per step (the bus share), for reports.
    bus_bytes: float
    fabric: str
    replica_fabric: str
    assumption: str

    @property
    def total_comm_s(self) -> float:
        return self.forward_comm_s + self.backward_comm_s + self.after_step_comm_s

    @property
    def exposed_s(self) -> float:
        return self.forward_exposed_s + self.backward_exposed_s + self.after_step_comm_s

    def overlap_cost_s(self, collective_overlap_slowdown: float) -> float:
        """Compute time the forward and backward collectives cost where compute hides them: NCCL's kernels
        take SMs and HBM bandwidth from the GEMMs beside them (`Hardware.collective_overlap_slowdown`,
        seconds lost per second overlapped; 0 on uncalibrated presets)."""
        overlapped = (self.forward_comm_s + self.backward_comm_s
                      - self.forward_exposed_s - self.backward_exposed_s)
        return collective_overlap_slowdown * max(overlapped, 0.0)


def check_sharding(gpus: int, zero_stage: int, shards: int) -> None:
    """The data-parallel layouts the model prices. Raises `ConfigError` naming the field."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError("gpus", gpus, "must be an integer >= 1")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or gpus % shards:
        raise ConfigError("training.zero_shards", shards, f"must divide the GPU count {gpus}")
    if zero_stage == 0 and shards != 1:
        raise ConfigError("training.zero_shards", shards, "ZeRO stage 0 shards nothing: must be 1")
    if zero_stage in (1, 2) and shards != gpus:
        raise ConfigError(
            "training.zero_shards", shards, f"stages 1 and 2 shard over every data-parallel GPU ({gpus})"
        )


def step_communication(
    *,
    num_params: int,
    param_bytes: int,
    grad_bytes: int,
    zero_stage: int,
    gpus: int,
    shards: int,
    topology: Topology,
    forward_compute_s: float,
    backward_compute_s: float,
    units: int,
) -> StepCommunication:
    """The collectives of one step of `gpus`-way data parallelism with ZeRO `zero_stage` over groups of
    `shards` GPUs (module docstring's table), with their overlap with forward and backward compute.

    `param_bytes` / `grad_bytes`: bytes per parameter of the gathered 16-bit parameters and of the
    gradients as reduced. `units`: sharding units (layers + the embedding/head group).
    """
    check_sharding(gpus, zero_stage, shards)
    params_s = num_params * param_bytes
    grads_s = num_params * grad_bytes
    fwd = bwd = after = 0.0
    bus = 0.0
    group = gpus if zero_stage in (0, 1, 2) else shards
    fabric = topology.fabric_for(group)
    replicas = gpus // shards if zero_stage == 3 else 1
    # Replicas of one shard sit `shards` GPUs apart (HSDP: shard groups fill a node first); the node's
    # replica rings all-reduce at once and share its NICs (`Topology.network_share`).
    replica_fabric = topology.fabric_for(replicas, stride=shards)
    frac = (group - 1) / group if group > 1 else 0.0
    if gpus == 1:
        assumption = "one GPU: no collective"
    elif zero_stage == 0:
        bwd = all_reduce_s(grads_s, gpus, fabric, units)  # one all-reduce per bucket (a unit)
        bus = 2 * grads_s * frac
        assumption = "DDP: gradient all-reduce overlaps backward, one layer per bucket"
    elif zero_stage in (1, 2):
        bwd = reduce_scatter_s(grads_s, gpus, fabric)
        after = all_gather_s(params_s, gpus, fabric)
        bus = (grads_s + params_s) * frac
        assumption = (
            "ZeRO-1/2: gradient reduce-scatter overlaps backward; all-gather of updated params after the "
            "optimizer step is exposed"
        )
    else:
        if shards > 1:
            # one gather and one reduce-scatter per sharding unit, each paying the ring's latency
            fwd = all_gather_s(params_s, shards, fabric, units)
            bwd = all_gather_s(params_s, shards, fabric, units) + reduce_scatter_s(grads_s, shards, fabric, units)
            bus = (2 * params_s + grads_s) * frac
        if replicas > 1:
            shard_grads = math.ceil(num_params / shards) * grad_bytes
            bwd += all_reduce_s(shard_grads, replicas, replica_fabric, units)
            bus += 2 * shard_grads * (replicas - 1) / replicas
        assumption = (
            "ZeRO-3/FSDP: next unit's param all-gather prefetched under compute; backward re-gather + "
            "gradient reduce-scatter overlap the next unit's backward"
        )
        if replicas > 1:
            assumption += "; HSDP: replica all-reduce of the gradient shard in backward"
    return StepCommunication(
        zero_stage=zero_stage,
        gpus=gpus,
        shards=shards,
        forward_comm_s=fwd,
        backward_comm_s=bwd,
        after_step_comm_s=after,
        forward_exposed_s=pipelined_exposed_s(fwd, forward_compute_s, units) if fwd else 0.0,
        backward_exposed_s=pipelined_exposed_s(bwd, backward_compute_s, units) if bwd else 0.0,
        bus_bytes=bus,
        fabric=fabric.name if gpus > 1 else "-",
        replica_fabric=replica_fabric.name if replicas > 1 else "-",
        assumption=assumption,
    )


def expert_step_communication(
    dense: StepCommunication,
    *,
    num_params: int,
    param_bytes: int,
    grad_bytes: int,
    gpus: int,
    topology: Topology,
    forward_compute_s: float,
    backward_compute_s: float,
    units: int,
    moe_layers: int,
) -> StepCommunication:
    """`dense` (the non-expert parameters' collectives over the dp x cp ranks that hold them) plus those of `num_params`
    routed-expert parameters under the same ZeRO stage over their expert data-parallel group of `gpus`
    ranks (dp x cp / ep: Megatron-Core's expert_data_parallel group, DeepSpeed-MoE's expert data
    parallel group, torchtitan's `efsdp` mesh), on `topology` as that group's ring sees it.

    What each stage adds, and the overlap rule (`dense`'s own, the module docstring's pipeline of units):

    - stages 0-2: the expert gradients all-reduce (stage 0, one per unit) or reduce-scatter once per
      step in the last backward, after the dense reduction, so under what is left of the backward once
      the dense collectives have hidden their part; ZeRO-1/2 then all-gather the updated expert
      parameters after the optimizer step, exposed (DeepSpeed's ZeRO-2 and Megatron's distributed
      optimizer reduce and gather the expert buffers over their own group, as the dense ones).
    - stage 3: each MoE layer's experts are their own sharding unit (torchtitan `apply_fsdp`:
      `fully_shard(block.moe.experts, mesh=edp_mesh)`), all-gathered in forward and again in backward
      and their gradients reduce-scattered, one call per MoE layer and phase (`moe_layers` calls);
      torchtitan prefetches a layer's experts with the layer (`set_modules_to_forward_prefetch([next
      block, next block's experts])`, likewise in backward), so one unit's communication is its dense
      plus its experts' collectives on the same stream: the pipeline over `units` units takes the
      phase's dense + expert communication as C. Paid per micro-batch, like the dense gathers.

    An expert group of one rank (ep = dp x cp) holds its experts whole: nothing is added.
    """
    if gpus == 1 or num_params == 0:
        note = "experts held whole by each rank (expert data-parallel group of 1)"
        return replace(dense, assumption=f"{dense.assumption}; {note}")
    stage = dense.zero_stage
    expert = step_communication(
        num_params=num_params, param_bytes=param_bytes, grad_bytes=grad_bytes, zero_stage=stage, gpus=gpus,
        shards=gpus if stage else 1, topology=topology, forward_compute_s=0.0, backward_compute_s=0.0,
        units=moe_layers if stage == 3 else units)
    fwd, bwd = dense.forward_comm_s + expert.forward_comm_s, dense.backward_comm_s + expert.backward_comm_s
    if stage == 3:
        fwd_exposed = pipelined_exposed_s(fwd, forward_compute_s, units) if fwd else 0.0
        bwd_exposed = pipelined_exposed_s(bwd, backward_compute_s, units) if bwd else 0.0
        how = (f"experts: ZeRO-3 over their {gpus}-rank expert data-parallel group ({expert.fabric}), each MoE "
               "layer's expert gather and gradient reduce-scatter prefetched with its layer")
    else:
        hidden = dense.backward_comm_s - dense.backward_exposed_s
        left = max(backward_compute_s - hidden, 0.0)
        fwd_exposed = dense.forward_exposed_s
        bwd_exposed = dense.backward_exposed_s + pipelined_exposed_s(expert.backward_comm_s, left, units)
        how = (f"experts: gradients reduced over their {gpus}-rank expert data-parallel group ({expert.fabric}) "
               "after the dense ones" + ("; their updated params all-gathered after the step" if stage else ""))
    return replace(
        dense, forward_comm_s=fwd, backward_comm_s=bwd,
        after_step_comm_s=dense.after_step_comm_s + expert.after_step_comm_s,
        forward_exposed_s=fwd_exposed, backward_exposed_s=bwd_exposed, bus_bytes=dense.bus_bytes + expert.bus_bytes,
        fabric=dense.fabric if expert.fabric == dense.fabric else f"{dense.fabric}, experts {expert.fabric}",
        assumption=f"{dense.assumption}; {how}")
