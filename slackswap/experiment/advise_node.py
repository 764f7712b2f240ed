"""What the advise search takes from the node it advises on: the collectives' topology, the graph per
micro-batch, the hardware one rank plans on and the pinned-host check (`experiment.advise`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from slackswap.communication import Topology
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig


def topology_from_node(node: Any, hardware: Hardware) -> Topology:
    """The two fabrics of `slackswap.node.Node` as the collectives see them: NVLink at the node's
    effective per-GPU NVLink bandwidth (what nccl-tests measures as busbw), the network at the bus
    bandwidth a ring leaving the node reaches (`Node.network_bus_bytes_per_s`: the node's NICs
    together, as nccl-tests measures it across nodes). A node
    without NVLink: ranks exchange through PCIe, at this GPU's effective host-link rate (the slower
    direction; an assumption, printed as the fabric name)."""
    from slackswap.communication import NCCL_RING_CALL_LATENCY_S as CALL
    from slackswap.communication import Fabric

    if node.nvlink_bytes_per_s > 0:
        intra = Fabric("nvlink", node.nvlink_bytes_per_s, node.nvlink_latency_s, CALL)
    else:
        link = hardware.link
        rate = min(link.h2d_effective_bytes_per_s, link.d2h_effective_bytes_per_s)
        intra = Fabric("pcie (no nvlink)", rate, link.latency_s, CALL)
    network = node.network_bus_bytes_per_s
    # a ring that leaves the node runs at its slowest link (slackswap.communication, model 1); its
    # per-step latency mixes NVLink and network hops as NCCL does (`Topology.fabric_for`)
    inter = (Fabric("network", min(network, intra.bus_bytes_per_s), node.nic_latency_s, CALL)
             if network > 0 else None)
    return Topology(node.gpus_per_node, intra, inter)


def graph_source(model: ModelConfig, hardware: Hardware, graph_mode: str, profile_source: str,
                 profile_options: Mapping[str, Any]) -> Callable[[int], Graph]:
    """A function micro-batch -> graph (no optimizer ops), cached per micro-batch. A traced preset
    searched on its analytic twin (`graph_mode == "analytic"`) takes the twin's attention kernel from
    the traced one (sdpa -> flash, else eager)."""
    from slackswap.profile import build_graph
    from slackswap.profile.sources import profile_graph

    cache: dict[int, Graph] = {}
    twin = model
    if profile_source == "torch" and graph_mode == "analytic":
        twin = replace(model, attention="flash" if profile_options.get("attention", "sdpa") == "sdpa" else "eager")

    def graph_for(mb: int) -> Graph:
        if mb not in cache:
            m = replace(twin, micro_batch_size=mb, include_optimizer=False)
            if graph_mode == "traced" and profile_source == "torch":
                cache[mb] = profile_graph("torch", m, hardware, None, **profile_options)
            else:
                cache[mb] = build_graph(m, hardware)
        return cache[mb]

    return graph_for


def rank_hardware(hardware: Hardware, node: Any, gpu_counts: Sequence[int]) -> dict[int, Hardware]:
    """Per GPU count, the hardware one rank plans on (`slackswap.sharing.shared_hardware`): one GPU
    is alone on its node (no switch uplink shared, the node's DRAM and duplex derate still apply);
    more GPUs share the node as a full node of ranks does (on fewer GPUs than the node holds that is
    conservative: their neighbours are taken as busy)."""
    from slackswap.sharing import shared_hardware

    one, _ = shared_hardware(hardware, replace(node, gpus_per_node=node.numa_nodes, gpus_per_pcie_switch=1))
    shared, _ = shared_hardware(hardware, node)
    return {g: (one if g == 1 else shared) for g in gpu_counts}


def host_check(node: Any) -> Callable[[int, int], str | None]:
    """(GPU count, pinned host bytes per rank: `SimResult.host_pinned_bytes`) -> why the node's pinned
    host memory cannot hold them, or
    None: a job on one GPU pins for one rank, a job on more for every GPU of the node."""
    from slackswap.node import pinned_reason

    def check(gpus: int, pinned_bytes: int) -> str | None:
        return pinned_reason(node, pinned_bytes, ranks=1 if gpus == 1 else None)

    return check
