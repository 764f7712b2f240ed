"""The host link one GPU really gets on a shared node: hardware + node -> the per-rank `Hardware`.

Data-parallel ranks run the same schedule in lockstep, so at every instant the k GPUs behind one
PCIe switch issue the same copy in the same direction. By that symmetry the switch uplink, shared
fairly, gives each exactly uplink / k, and the host DRAM of a NUMA node gives each exactly its
1 / (GPUs per NUMA node) share: one rank simulated at those rates is the node, with no need to
simulate the k ranks together (docs/hardware.md, "Shared host links").

What is not exact, and is a bound instead: the duplex derate (a copy slows when the opposite
direction runs) is applied to every copy of the step, as if the other direction always ran. The
simulator times each copy once, when it starts, so it cannot change a copy's rate mid-flight; the
derate throughout gives copy times that are never shorter than the real ones, so the figures on a
node are a lower bound on throughput retained and a plan that hides its copies here hides them
there too.

Planners and the simulator all read the same derived `Hardware`, so they plan against the shared
bandwidth and are scored on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slackswap.hardware import Hardware
from slackswap.node import Node

#: The names of what limits a direction, as reported in `SharedLink` and metrics.json.
LIMITS: tuple[str, ...] = ("gpu_link", "switch_uplink", "host_dram")


@dataclass(frozen=True)
class SharedLink:
    """Per-GPU effective bandwidths after sharing, and what set each (for the printed table)."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_limit: str
    d2h_limit: str
    #: GPUs sharing one switch uplink (1 when each GPU has its own path).
    sharing_gpus: int

    def metrics(self) -> dict[str, object]:
        return {
            "effective_h2d_gbps": self.h2d_bytes_per_s / 1e9,
            "effective_d2h_gbps": self.d2h_bytes_per_s / 1e9,
            "h2d_limit": self.h2d_limit,
            "d2h_limit": self.d2h_limit,
            "sharing_gpus": self.sharing_gpus,
        }


def _one_direction(own: float, uplink: float | None, node: Node, duplex: float) -> tuple[float, str]:
    rate, limit = own, "gpu_link"
    if uplink is not None:
        share = uplink * (1.0 - node.nic_uplink_fraction) / node.gpus_per_pcie_switch
        if share < rate:
            rate, limit = share, "switch_uplink"
    return rate * duplex, limit


def shared_link(hardware: Hardware, node: Node) -> SharedLink:
    """Each direction: min(own link, uplink share) x duplex derate, then both scaled down together
    if their sum exceeds this GPU's share of the NUMA node's DRAM bandwidth."""
    link = hardware.link
    h2d, h2d_limit = _one_direction(link.h2d_effective_bytes_per_s, node.switch_uplink_h2d_bytes_per_s, node,
                                    node.h2d_duplex_fraction)
    d2h, d2h_limit = _one_direction(link.d2h_effective_bytes_per_s, node.switch_uplink_d2h_bytes_per_s, node,
                                    node.d2h_duplex_fraction)
    if node.host_dram_bytes_per_numa_s is not None:
        dram_share = node.host_dram_bytes_per_numa_s / node.gpus_per_numa
        if h2d + d2h > dram_share:
            scale = dram_share / (h2d + d2h)
            h2d, d2h, h2d_limit, d2h_limit = h2d * scale, d2h * scale, "host_dram", "host_dram"
    return SharedLink(h2d, d2h, h2d_limit, d2h_limit, node.gpus_per_pcie_switch)


def shared_hardware(hardware: Hardware, node: Node) -> tuple[Hardware, SharedLink]:
    """The per-rank hardware on `node` (same GPU, its link at the shared rates, plus the node's
    per-tensor pinning cost on every offload) and the report of what each GPU got."""
    shared = shared_link(hardware, node)
    link = replace(
        hardware.link,
        h2d_effective_bytes_per_s=shared.h2d_bytes_per_s,
        d2h_effective_bytes_per_s=shared.d2h_bytes_per_s,
        d2h_setup_s=hardware.link.d2h_setup_s + node.pin_setup_s_per_tensor,
    )
    return replace(hardware, link=link), shared
