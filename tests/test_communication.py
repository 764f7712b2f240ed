"""The collective model of slackswap.communication against figures worked by hand."""

from __future__ import annotations

import pytest

from slackswap.communication import (
    Fabric,
    Topology,
    all_gather_s,
    all_reduce_s,
    check_sharding,
    expert_step_communication,
    not_modelled,
    pipelined_exposed_s,
    rate_limited_all_gathers,
    reduce_scatter_s,
    step_communication,
)
from slackswap.errors import ConfigError

NVLINK = Fabric("nvlink", 200e9, 5e-6)
NET = Fabric("ib", 20e9, 10e-6)
NODE = Topology(gpus_per_node=8, intra_node=NVLINK, inter_node=NET)


def test_ring_formulas_by_hand():
    # 1 GB over 8 ranks at 200 GB/s busbw, alpha 5 us: 7 x 5 us + 1e9 x 7/8 / 200e9 = 35 us + 4.375 ms.
    assert all_gather_s(1e9, 8, NVLINK) == pytest.approx(4.410e-3)
    assert reduce_scatter_s(1e9, 8, NVLINK) == pytest.approx(4.410e-3)
    # All-reduce: twice the steps and twice the bus bytes: 70 us + 8.75 ms.
    assert all_reduce_s(1e9, 8, NVLINK) == pytest.approx(8.820e-3)
    # nccl-tests' definition: busbw = algbw x 2(n-1)/n for all-reduce, so at large sizes (alpha
    # negligible) the bus bandwidth computed back from the time is the fabric's.
    t = all_reduce_s(1e12, 8, Fabric("x", 200e9, 0.0))
    assert (1e12 / t) * 2 * 7 / 8 == pytest.approx(200e9)
    # Two ranks: one step, half the buffer.
    assert all_gather_s(2e9, 2, NET) == pytest.approx(10e-6 + 1e9 / 20e9)
    # One rank: nothing to send.
    assert all_gather_s(1e9, 1, NVLINK) == 0.0 == all_reduce_s(1e9, 1, NVLINK)


def test_pipelined_overlap_by_hand():
    # C = 10, P = 8 over 4 units: c = 2.5, p = 2: 2.5 + 3 x 2.5 + 2 = 12, exposed 12 - 8 = 4.
    assert pipelined_exposed_s(10.0, 8.0, 4) == pytest.approx(4.0)
    # Communication shorter per unit than compute: only the first unit's share shows (C / k).
    assert pipelined_exposed_s(4.0, 8.0, 4) == pytest.approx(1.0)
    # One unit: nothing overlaps.
    assert pipelined_exposed_s(4.0, 8.0, 1) == pytest.approx(4.0)
    # No compute to hide under: all of it.
    assert pipelined_exposed_s(4.0, 0.0, 8) == pytest.approx(4.0)


def test_fabric_choice_follows_the_node():
    assert NODE.fabric_for(8).name == "nvlink"
    assert NODE.fabric_for(16).name == "ib"
    # Replicas of an HSDP shard sit `shards` apart: 2 replicas of an 8-way shard span two nodes.
    assert NODE.fabric_for(2, stride=8).name == "ib"
    assert NODE.fabric_for(2, stride=4).name == "nvlink"


def test_zero3_step_on_eight_gpus_by_hand():
    p = 1_000_000_000  # 1 B parameters, bf16 params and grads: 2 GB buffers
    comm = step_communication(
        num_params=p, param_bytes=2, grad_bytes=2, zero_stage=3, gpus=8, shards=8, topology=NODE,
        forward_compute_s=1.0, backward_compute_s=2.0, units=10,
    )
    ag = 10 * 7 * 5e-6 + 2e9 * 7 / 8 / 200e9  # one gather per unit, each 7 steps of 5 us: 9.1 ms
    assert comm.forward_comm_s == pytest.approx(ag)
    assert comm.backward_comm_s == pytest.approx(2 * ag)  # re-gather + reduce-scatter
    assert comm.after_step_comm_s == 0.0
    # Per unit 0.88 ms of gather against 100 ms of forward: only the first unit's share is exposed.
    assert comm.forward_exposed_s == pytest.approx(ag / 10)
    assert comm.backward_exposed_s == pytest.approx(2 * ag / 10)
    assert comm.bus_bytes == pytest.approx(3 * 2e9 * 7 / 8)
    assert comm.fabric == "nvlink"


def test_overlapped_collectives_cost_compute_at_the_presets_fitted_rate():
    comm = step_communication(
        num_params=1_000_000_000, param_bytes=2, grad_bytes=2, zero_stage=3, gpus=8, shards=8, topology=NODE,
        forward_compute_s=1.0, backward_compute_s=2.0, units=10,
    )
    ag = 10 * 7 * 5e-6 + 2e9 * 7 / 8 / 200e9
    hidden = 3 * ag - 3 * ag / 10  # every unit's share but the first is under compute
    assert comm.overlap_cost_s(0.0) == 0.0
    assert comm.overlap_cost_s(0.5) == pytest.approx(0.5 * hidden)


def test_fsdp1_rate_limits_the_gathers_of_strategies_that_free_after_forward():
    """FullyShardedDataParallel's rate limiter holds each unit's gather in forward and its re-gather in
    backward at stage 3 (FULL_SHARD; HYBRID_SHARD is stage 3 over fewer shards than GPUs); nothing at
    stages 0-2 (SHARD_GRAD_OP keeps the parameters), with nothing sharded, or under fully_shard."""
    assert rate_limited_all_gathers(True, 3, 8, 33) == 66
    assert rate_limited_all_gathers(True, 3, 1, 33) == 0
    assert all(rate_limited_all_gathers(True, stage, 8, 33) == 0 for stage in (0, 1, 2))
    assert rate_limited_all_gathers(False, 3, 8, 33) == 0


def test_the_caveat_says_whether_overlap_costs_compute():
    """Printed with every advise answer: a preset with a fitted slowdown must not say "free"."""
    assert "free" in not_modelled(0.0)
    fitted = not_modelled(0.44)
    assert "free" not in fitted and "0.44" in fitted and "hardware.collective_overlap_slowdown" in fitted


def test_stages_issue_the_documented_collectives():
    kw = dict(num_params=10**9, param_bytes=2, grad_bytes=4, topology=NODE,
              forward_compute_s=1.0, backward_compute_s=2.0, units=10)
    ddp = step_communication(zero_stage=0, gpus=8, shards=1, **kw)
    assert ddp.forward_comm_s == 0 and ddp.after_step_comm_s == 0
    assert ddp.backward_comm_s == pytest.approx(all_reduce_s(4e9, 8, NVLINK, calls=10))  # a bucket per unit
    z2 = step_communication(zero_stage=2, gpus=8, shards=8, **kw)
    assert z2.backward_comm_s == pytest.approx(reduce_scatter_s(4e9, 8, NVLINK))
    # The all-gather of the updated parameters after the step has nothing to hide under.
    assert z2.after_step_comm_s == pytest.approx(all_gather_s(2e9, 8, NVLINK))
    assert z2.exposed_s >= z2.after_step_comm_s
    # HSDP over 16 GPUs in shard groups of 8: gathers on NVLink, the replica all-reduce of the
    # 1/8 gradient shard over the network.
    hsdp = step_communication(zero_stage=3, gpus=16, shards=8, **kw)
    assert hsdp.fabric == "nvlink" and hsdp.replica_fabric == "ib"
    expected = (all_gather_s(2e9, 8, NVLINK, 10) + reduce_scatter_s(4e9, 8, NVLINK, 10)
                + all_reduce_s(5e8, 2, NODE.fabric_for(2, stride=8), 10))
    assert hsdp.backward_comm_s == pytest.approx(expected)
    one = step_communication(zero_stage=3, gpus=1, shards=1, **kw)
    assert one.total_comm_s == 0 and one.exposed_s == 0


def test_hsdp_replica_rings_share_the_nodes_nics_by_hand():
    """2 nodes x 8 GPUs, HSDP with 8-GPU shard groups: 8 replica all-reduces (one per local rank) cross
    each node at once, so each ring gets the node's network busbw / 8 (NET's 20 GB/s: 2.5 GB/s)."""
    p = 1_000_000_000  # bf16 gradients: 2 GB, a 1/8 shard of 250 MB per rank
    hsdp = step_communication(num_params=p, param_bytes=2, grad_bytes=2, zero_stage=3, gpus=16, shards=8,
                              topology=NODE, forward_compute_s=1.0, backward_compute_s=2.0, units=1)
    ring = 2 * (7 * 5e-6 + 2e9 * 7 / 8 / 200e9)  # the shard group's re-gather + reduce-scatter on NVLink
    # Replica all-reduce over 2 ranks, one network step each way (10 us) and 2 x 250 MB x 1/2 at 2.5 GB/s.
    replica = 2 * 10e-6 + 2 * 250e6 * 1 / 2 / 2.5e9
    assert replica == pytest.approx(0.10002)
    assert hsdp.backward_comm_s == pytest.approx(ring + replica)
    assert NODE.network_share(2, stride=8) == 1 / 8
    # One ring over all 16 GPUs has the node's NICs to itself; 4-GPU shard groups: 4 rings of 2 GPUs a node.
    assert NODE.fabric_for(16).bus_bytes_per_s == 20e9
    assert NODE.fabric_for(4, stride=4).bus_bytes_per_s == pytest.approx(20e9 * 2 / 8)
    # The data-parallel ring under tp=2 (ranks 2 apart) sees half of each node and half of its NICs.
    assert NODE.strided(2).fabric_for(8).bus_bytes_per_s == pytest.approx(10e9)
    assert NODE.strided(2).fabric_for(8).bus_bytes_per_s == NODE.fabric_for(8, stride=2).bus_bytes_per_s


def test_communication_bound_when_compute_is_short():
    # 16 GPUs over the network, tiny compute: nearly all of the communication shows.
    comm = step_communication(num_params=10**9, param_bytes=2, grad_bytes=2, zero_stage=3, gpus=16, shards=16,
                              topology=NODE, forward_compute_s=1e-3, backward_compute_s=2e-3, units=10)
    assert comm.fabric == "ib"
    assert comm.exposed_s > 0.9 * (comm.total_comm_s - 3e-3)


@pytest.mark.parametrize(
    ("gpus", "stage", "shards", "field"),
    [(0, 3, 1, "gpus"), (8, 3, 3, "training.zero_shards"), (8, 0, 8, "training.zero_shards"),
     (8, 2, 4, "training.zero_shards")],
)
def test_bad_layouts_name_the_field(gpus, stage, shards, field):
    with pytest.raises(ConfigError) as info:
        check_sharding(gpus, stage, shards)
    assert info.value.field == field


def test_ring_latency_grows_with_the_rank_count_as_nccl_prices_it():
    """NVIDIA/nccl src/graph/tuning.cc: a ring all-gather over n ranks on N nodes costs the base
    latency + (n - N) intra-node hops + (N - 1) network hops; FSDP pays it once per unit."""
    nccl = Topology(8, Fabric("nvlink", 450e9, 3.4e-6, 8.4e-6), Fabric("net", 340e9, 14e-6, 8.4e-6))

    def latency_us(n: int) -> float:
        return all_gather_s(0.0, n, nccl.fabric_for(n)) * 1e6

    assert latency_us(8) == pytest.approx(8.4 + 7 * 3.4)  # one node: NVLink hops only
    assert latency_us(128) == pytest.approx(8.4 + 112 * 3.4 + 15 * 14)  # 599.2 us
    assert latency_us(512) == pytest.approx(8.4 + 448 * 3.4 + 63 * 14)  # 2413.6 us
    # all-reduce: twice the steps, one base latency
    assert all_reduce_s(0.0, 512, nccl.fabric_for(512)) * 1e6 == pytest.approx(8.4 + 2 * (448 * 3.4 + 63 * 14))
    # the same bytes in 81 calls (a 70B model's layers + embeddings) pay the latency 81 times
    f = nccl.fabric_for(512)
    one, per_unit = all_gather_s(1e9, 512, f), all_gather_s(1e9, 512, f, calls=81)
    assert per_unit - one == pytest.approx(80 * latency_us(512) * 1e-6)
    # and the step's collectives grow with the GPU count at the same bytes per GPU
    kw = dict(num_params=10**9, param_bytes=2, grad_bytes=4, zero_stage=3, topology=nccl,
              forward_compute_s=1.0, backward_compute_s=2.0, units=25)
    small, large = (step_communication(gpus=g, shards=g, **kw) for g in (128, 512))
    assert large.total_comm_s - small.total_comm_s == pytest.approx(3 * 25 * (2413.6 - 599.2) * 1e-6, rel=0.01)
    with pytest.raises(ConfigError, match="calls"):
        all_gather_s(1e9, 8, f, calls=0)


def test_bad_fabric_names_the_field():
    with pytest.raises(ConfigError, match="fabric.bus_bytes_per_s"):
        Fabric("x", 0.0, 1e-6)
    with pytest.raises(ConfigError, match="fabric.latency_s"):
        Fabric("x", 1e9, -1.0)
    with pytest.raises(ConfigError, match="fabric.call_latency_s"):
        Fabric("x", 1e9, 1e-6, -1.0)


def test_expert_collectives_by_hand():
    """Routed experts over a 2-rank expert data-parallel group beside 1e9 dense parameters over 8 GPUs
    (latency 0, 100 GB/s: bytes only). ZeRO-3: each layer's expert gather rides its layer's unit, so
    the pipeline takes the dense + expert time as C; ZeRO-2: the expert reduce-scatter under what the
    dense one leaves of the backward, both updated-parameter gathers after the step."""
    topo = Topology(8, Fabric("nvlink", 100e9, 0.0), Fabric("ib", 10e9, 0.0))
    kw = dict(num_params=10**9, param_bytes=2, grad_bytes=2, topology=topo, gpus=8, shards=8, units=10)
    ekw = dict(num_params=4 * 10**9, param_bytes=2, grad_bytes=2, gpus=2, topology=topo, units=10, moe_layers=9)
    dense = step_communication(zero_stage=3, forward_compute_s=0.05, backward_compute_s=0.2, **kw)
    z3 = expert_step_communication(dense, forward_compute_s=0.05, backward_compute_s=0.2, **ekw)
    # dense gather 2e9 B x 7/8 / 100e9 = 0.0175 s, expert gather 8e9 x 1/2 / 100e9 = 0.04 s
    assert z3.forward_comm_s == pytest.approx(0.0575)
    assert z3.backward_comm_s == pytest.approx(2 * 0.0175 + 2 * 0.04)  # re-gather + reduce-scatter each
    # forward: c = 0.00575 > p = 0.005 per unit: C - 9 p = 0.0125 exposed; backward: c < p, one unit's c
    assert z3.forward_exposed_s == pytest.approx(0.0575 - 9 * 0.005)
    assert z3.backward_exposed_s == pytest.approx(0.0115)
    assert z3.after_step_comm_s == 0
    assert z3.bus_bytes == pytest.approx((4e9 + 2e9) * 7 / 8 + (16e9 + 8e9) / 2)
    dense2 = step_communication(zero_stage=2, forward_compute_s=0.05, backward_compute_s=0.2, **kw)
    z2 = expert_step_communication(dense2, forward_compute_s=0.05, backward_compute_s=0.2, **ekw)
    assert z2.forward_comm_s == 0 and z2.backward_comm_s == pytest.approx(0.0175 + 0.04)
    assert z2.after_step_comm_s == pytest.approx(0.0175 + 0.04)  # both gathers of updated parameters
    # dense: 0.00175 exposed, 0.01575 hidden; experts: c = 0.004 under (0.2 - 0.01575) / 10 per unit
    assert z2.backward_exposed_s == pytest.approx(0.00175 + 0.004)
    assert z2.bus_bytes == pytest.approx((2e9 + 2e9) * 7 / 8 + (8e9 + 8e9) / 2)
    # an expert group of one rank holds its experts whole: nothing added
    whole = expert_step_communication(dense, forward_compute_s=0.05, backward_compute_s=0.2, **{**ekw, "gpus": 1})
    assert whole.total_comm_s == dense.total_comm_s and whole.exposed_s == dense.exposed_s
    assert "expert data-parallel group of 1" in whole.assumption
