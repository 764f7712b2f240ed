"""The machine around the GPU: how many GPUs share one PCIe switch, one host and one NIC.

A `Hardware` preset describes one GPU and its own host link as if it were alone. A training job
rarely is: a DGX A100 puts two GPUs behind each PCIe switch, whose single x16 uplink carries both
GPUs' copies (and the NICs' traffic), and a PCIe copy engine pair slows down when both directions run
at once. `Node` holds those facts (from conf/node/*.yaml, every figure cited there) and
`slackswap.sharing` turns hardware + node into the per-GPU link one rank really gets.

Besides the host path, a node carries the figures a data-parallel cost model needs (NVLink bandwidth
per GPU, inter-node network bandwidth per GPU and their latencies) and the pinned host memory that
every rank of the node draws its offload buffers from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slackswap import validation as check
from slackswap.errors import ConfigError, reject_unknown_fields

#: Where the NICs sit: on the GPUs' PCIe switches (their traffic shares the switch uplink with the
#: activation copies, as on DGX A100 / HGX H100), on their own root ports, or there are none.
NIC_PLACEMENTS: tuple[str, ...] = ("gpu_switch", "own_root_port", "none")


@dataclass(frozen=True)
class Node:
    """One server: its GPUs, PCIe switches, host memory, NICs and NVLink, as the link model sees them.

    Bandwidths are effective (what a pinned copy or a collective reaches), per direction. Every rank
    of the node is assumed to run the same schedule in lockstep (data parallelism), which is what
    makes the per-GPU share exact by symmetry (docs/hardware.md, "Shared host links").
    """

    name: str
    #: GPUs (= data-parallel ranks) on this node; each runs the same step at the same time.
    gpus_per_node: int
    #: GPUs whose host copies share one PCIe switch uplink (1: each GPU has its own path to the host).
    gpus_per_pcie_switch: int
    #: Effective bandwidth of one switch uplink per direction, shared by the GPUs behind it. None: no
    #: switch between the GPU and the CPU root port, the GPU's own link is the only limit.
    switch_uplink_h2d_bytes_per_s: float | None
    switch_uplink_d2h_bytes_per_s: float | None
    #: Share of each direction's one-way rate a copy keeps while the opposite direction also runs.
    h2d_duplex_fraction: float
    d2h_duplex_fraction: float
    #: CPU sockets (NUMA nodes); GPUs are spread evenly over them.
    numa_nodes: int
    #: Host DRAM bandwidth of one NUMA node (both directions of all its GPUs' copies draw on it).
    #: None: not a limit worth modelling (one GPU on a host whose DRAM far outruns its link).
    host_dram_bytes_per_numa_s: float | None
    #: Pinned host memory the node can give to offload buffers, for all its ranks together.
    pinned_host_bytes: int
    #: Host-side cost per offloaded tensor before its copy can start: 0 for a runtime with a pinned
    #: buffer pool; a cudaHostAlloc per tensor costs milliseconds (conf/node cites it).
    pin_setup_s_per_tensor: float = 0.0
    nic_placement: str = "none"
    nics_per_node: int = 0
    #: Effective network bandwidth of one NIC per direction, and the latency of one ring step that
    #: crosses the network as NCCL prices it (its tuning model's per-hop latency, not the NIC port's).
    nic_bytes_per_s: float = 0.0
    nic_latency_s: float = 0.0
    #: NCCL bus bandwidth of a collective whose ring leaves the node (nccl-tests' busbw at large
    #: sizes), bytes/s. None: the node's aggregate NIC rate, `nics_per_node x nic_bytes_per_s` (see
    #: `network_bus_bytes_per_s`); conf/node cites the measurement where there is one.
    network_busbw_bytes_per_s: float | None = None
    #: Share of a switch uplink that inter-node traffic holds while activation copies run (0 on one
    #: node: its gradient collectives go over NVLink, not through the switch).
    nic_uplink_fraction: float = 0.0
    #: NVLink bandwidth per GPU per direction (0: no NVLink) and the latency of one NVLink ring step
    #: (NCCL's tuning model's per-hop latency).
    nvlink_bytes_per_s: float = 0.0
    nvlink_latency_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("node.name", self.name, "must be a non-empty string")
        check.integer("node.gpus_per_node", self.gpus_per_node, 1)
        check.integer("node.gpus_per_pcie_switch", self.gpus_per_pcie_switch, 1)
        if self.gpus_per_node % self.gpus_per_pcie_switch:
            raise ConfigError(
                "node.gpus_per_pcie_switch", self.gpus_per_pcie_switch,
                f"must divide node.gpus_per_node={self.gpus_per_node}",
            )
        for name in ("switch_uplink_h2d_bytes_per_s", "switch_uplink_d2h_bytes_per_s", "host_dram_bytes_per_numa_s",
                     "network_busbw_bytes_per_s"):
            if getattr(self, name) is not None:
                check.positive(f"node.{name}", getattr(self, name))
        if self.gpus_per_pcie_switch > 1:
            for name in ("switch_uplink_h2d_bytes_per_s", "switch_uplink_d2h_bytes_per_s"):
                if getattr(self, name) is None:
                    raise ConfigError(
                        f"node.{name}", None, f"is needed: {self.gpus_per_pcie_switch} GPUs share each switch"
                    )
        for name in ("h2d_duplex_fraction", "d2h_duplex_fraction"):
            check.fraction(f"node.{name}", getattr(self, name))
        check.integer("node.numa_nodes", self.numa_nodes, 1)
        if self.gpus_per_node % self.numa_nodes:
            raise ConfigError(
                "node.numa_nodes", self.numa_nodes, f"must divide node.gpus_per_node={self.gpus_per_node}"
            )
        check.integer("node.pinned_host_bytes", self.pinned_host_bytes, 1)
        for name in ("pin_setup_s_per_tensor", "nic_bytes_per_s", "nic_latency_s", "nvlink_bytes_per_s",
                     "nvlink_latency_s"):
            check.non_negative(f"node.{name}", getattr(self, name))
        if self.nic_placement not in NIC_PLACEMENTS:
            raise ConfigError("node.nic_placement", self.nic_placement, f"must be one of {NIC_PLACEMENTS}")
        check.integer("node.nics_per_node", self.nics_per_node, 0)
        if (self.nic_placement == "none") != (self.nics_per_node == 0):
            raise ConfigError(
                "node.nics_per_node", self.nics_per_node, f"contradicts node.nic_placement={self.nic_placement!r}"
            )
        if self.nics_per_node and self.nic_bytes_per_s == 0:
            raise ConfigError("node.nic_bytes_per_s", self.nic_bytes_per_s, "must be positive when the node has NICs")
        if self.network_busbw_bytes_per_s is not None and self.network_busbw_bytes_per_s > self.nic_line_bytes_per_s:
            raise ConfigError(
                "node.network_busbw_bytes_per_s", self.network_busbw_bytes_per_s,
                f"exceeds the aggregate NIC rate {self.nic_line_bytes_per_s:g} (nics_per_node x nic_bytes_per_s)",
            )
        check.fraction("node.nic_uplink_fraction", self.nic_uplink_fraction, zero=True, one=False)
        if self.nic_uplink_fraction and self.nic_placement != "gpu_switch":
            raise ConfigError(
                "node.nic_uplink_fraction", self.nic_uplink_fraction,
                "only NICs on the GPUs' PCIe switches (nic_placement=gpu_switch) share the uplink",
            )

    @property
    def gpus_per_numa(self) -> int:
        return self.gpus_per_node // self.numa_nodes

    @property
    def network_bytes_per_s_per_gpu(self) -> float:
        """Inter-node bandwidth one GPU gets when every GPU of the node sends at once (0: no NIC)."""
        return self.nics_per_node * self.nic_bytes_per_s / self.gpus_per_node

    @property
    def nic_line_bytes_per_s(self) -> float:
        """The node's aggregate NIC rate per direction (0: no NIC)."""
        return self.nics_per_node * self.nic_bytes_per_s

    @property
    def network_bus_bytes_per_s(self) -> float:
        """The bus bandwidth B of a ring collective that spans nodes (0: no NIC).

        Not one NIC's share per GPU: NCCL runs one ring (channel) per NIC, and in each ring only one
        hop per node crosses the network while the others ride NVLink, so nccl-tests' busbw across
        nodes follows the node's aggregate NIC rate. Measured on 8-GPU A100 nodes with 4 x 200 Gb/s
        NICs (100 GB/s aggregate): all-reduce busbw ~84.8 GB/s average, ~96 peak over 3 nodes
        (NVIDIA/nccl-tests issue 119), ~86 GB/s over 2 nodes (NVIDIA/nccl-tests issue 175); the
        per-GPU share (12.5 GB/s there) would be 6.8-7.7x too slow. A node that states its measured
        busbw (`network_busbw_bytes_per_s`) uses it; otherwise the aggregate line rate, an upper bound.
        """
        if self.network_busbw_bytes_per_s is not None:
            return float(self.network_busbw_bytes_per_s)
        return self.nic_line_bytes_per_s

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Node:
        """Build from a plain mapping (a resolved Hydra node or parsed YAML). Unknown keys are errors."""
        data = dict(data)
        reject_unknown_fields("node", data, cls.__dataclass_fields__)
        for required in ("name", "gpus_per_node", "gpus_per_pcie_switch", "switch_uplink_h2d_bytes_per_s",
                         "switch_uplink_d2h_bytes_per_s", "h2d_duplex_fraction", "d2h_duplex_fraction",
                         "numa_nodes", "host_dram_bytes_per_numa_s", "pinned_host_bytes"):
            if required not in data:
                raise ConfigError(f"node.{required}", None, "is required")
        return cls(**data)


def pinned_reason(node: Node, pinned_bytes: int, ranks: int | None = None) -> str | None:
    """Why a plan does not fit the node's pinned host memory, or None when it fits.

    Every rank of the node runs the same plan, so each pins `pinned_bytes`: the simulator's
    `SimResult.host_pinned_bytes`, the runtime's slab of a buffer per offload
    (`slackswap.schedule.positions.PlanPositions.pinned_slab_bytes`). Its host copies are live at once
    for at most `SimResult.host_peak_bytes` of it.
    `ranks`: how many ranks of the plan share the node's host memory (default: every GPU of the node;
    a job on one GPU of the node has one).
    """
    ranks = node.gpus_per_node if ranks is None else ranks
    needed = pinned_bytes * ranks
    if needed <= node.pinned_host_bytes:
        return None
    return (
        f"pinned host memory: {ranks} rank(s) x {pinned_bytes / 2**30:.2f} GiB of pinned host buffers = "
        f"{needed / 2**30:.2f} GiB exceeds node {node.name!r}'s {node.pinned_host_bytes / 2**30:.2f} GiB "
        "(node.pinned_host_bytes)"
    )
