"""What one rank of a calibration row moves and holds: its micro-batch's FSDP collectives (their seconds
on the node's fabric and the bytes they move through it, which benchmarks/calibration.py prices into
the step) and the model's estimate of its memory (printed beside a miss)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from benchmarks.common import conf
from slackswap.hardware import Hardware


@functools.cache
def node_conf(name: str) -> dict:
    """The node preset's mapping, parsed once per process (read-only here)."""
    return conf("node", name)


@dataclass(frozen=True)
class MicroCollectives:
    """The FSDP collectives of one micro-batch on one rank: seconds in forward and in backward, and the
    bytes each phase's collectives move through the rank (nccl-tests' bus bytes: a ring all-gather or
    reduce-scatter of S bytes over n ranks moves S (n - 1) / n, an all-reduce twice that): what an
    overlap cost per GB would charge, the variant calibration_fit.py weighs against the per-second one."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    units: int = 1
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    #: All-gathers FSDP1's rate limiter holds the CPU thread on (`rate_limited_all_gathers`).
    rate_limited: int = 0


def micro_collectives(meas, num_params: int, hw: Hardware) -> MicroCollectives:
    """Composer FSDP issues its collectives on every micro-batch: it wraps only DDP models in `no_sync`
    (mosaicml/composer composer/trainer/dist_strategy.py, `ddp_sync_context`: "if not
    isinstance(state.model, DistributedDataParallel): yield"), so under gradient accumulation each
    micro-batch all-gathers the 16-bit parameters in forward (FULL_SHARD: again in backward, as they
    were freed after forward) and reduce-scatters its gradients (fp32 under DEFAULT mixed precision).
    Ring times on the node's fabric (slackswap.communication); sharding units are the layers plus the
    embedding/head group, and each unit's gather and reduce-scatter is its own NCCL call, paying the
    ring's latency (NCCL's tuning model: per step 3.4 us on NVLink, 14 us across the network), so a
    512-rank ring costs more than a 128-rank one at the same bytes. `meas`: a calibration Measurement."""
    from slackswap.communication import all_gather_s, all_reduce_s, rate_limited_all_gathers, reduce_scatter_s
    from slackswap.experiment.advise_node import topology_from_node
    from slackswap.memory.recipe import FSDP1
    from slackswap.node import Node

    if not meas.sharding or meas.shards == 1:
        return MicroCollectives()
    topology = topology_from_node(Node.from_dict(node_conf(meas.node) | dict(meas.node_overrides)), hw)
    fabric = topology.fabric_for(meas.shards)
    units = meas.model["num_layers"] + 1
    ring_share = (meas.shards - 1) / meas.shards
    params = all_gather_s(2 * num_params, meas.shards, fabric, units)
    grads = reduce_scatter_s(meas.grad_reduce_bytes * num_params, meas.shards, fabric, units)
    params_bytes = 2 * num_params * ring_share
    grads_bytes = meas.grad_reduce_bytes * num_params * ring_share
    if meas.replicas > 1:
        # HYBRID_SHARD: each shard's gradients all-reduced across the nodes (PyTorch FSDP docs). The
        # node's replica rings run at once and share its NICs: `fabric_for` gives one its share
        # (`Topology.network_share`: 1 / 8 with 8-GPU shard groups on 8-GPU nodes).
        ring = topology.fabric_for(meas.replicas, stride=meas.shards)
        shard_bytes = meas.grad_reduce_bytes * num_params / meas.shards
        grads += all_reduce_s(shard_bytes, meas.replicas, ring, units)
        grads_bytes += 2 * shard_bytes * (meas.replicas - 1) / meas.replicas
    full_shard = meas.sharding == "FULL_SHARD"
    # FULL_SHARD and HYBRID_SHARD free the parameters after forward (ZeRO stage 3; SHARD_GRAD_OP: 2).
    stage = 3 if meas.sharding in ("FULL_SHARD", "HYBRID_SHARD") else 2
    return MicroCollectives(params, grads + (params if full_shard else 0.0), units,
                            params_bytes, grads_bytes + (params_bytes if full_shard else 0.0),
                            rate_limited_all_gathers(meas.fsdp_api == FSDP1, stage, meas.shards, units))


def rank_memory_share(meas, model, training, graph, hw: Hardware) -> float | None:
    """The model's own estimate of one rank's peak over the part's memory: the sharded training state
    (`slackswap.memory.static`, the row's shards) plus the simulated activation peak of the step as the
    row runs it (keep-all, or full recompute where it checkpoints every layer); None where the source
    does not state the sharding (the state is not known) or runs a selective policy ("layers:K", "op",
    whose peak the calibration step does not plan). Printed beside a miss that memory pressure is a
    candidate cause of, to say whether the estimate supports it. `model`, `training`: the row's workload."""
    from slackswap.memory.static import static_memory
    from slackswap.planners.registry import get_planner
    from slackswap.simulate import simulate

    if meas.recompute or not meas.sharding:
        return None
    state = static_memory(graph.meta["num_params"], graph.meta["max_unit_params"], training, model.dtype)
    plan = get_planner("full_recompute" if meas.checkpointing else "keep_all").plan(graph, hw, None)
    peak = simulate(graph, plan, hw, None).peak_activation_bytes
    return (state.total_bytes + peak) / hw.device_memory_bytes
