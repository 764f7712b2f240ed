"""Which network a published run can have had: its FSDP traffic against its step and the GPUs' links.

A source that states one network rate ("400Gbps") without saying per node or per GPU leaves two
readings, and for fms-fsdp's rows the reading moves the prediction from 0.75-1.05 of the published
figure (per node) to 0.99-1.24 (per GPU) (benchmarks/calibration_rows.py, NETWORK_READINGS). Rather
than keep the reading whose rows fit better, each reading is held to two physical bounds that no
fitted figure enters:

1. **The collectives fit in the step.** Per optimizer step, each node's NICs carry (in nccl-tests'
   bus bytes, so time = bytes / busbw; NVIDIA/nccl-tests/doc/PERFORMANCE.md):

   - FULL_SHARD over N GPUs of several nodes: (p + p + r) P (N - 1) / N: the p-byte parameters
     all-gathered in forward and again in backward (FSDP frees them after forward), and the r-byte
     gradients reduce-scattered (the reduce dtype the source states);
   - HYBRID_SHARD (FSDP over the s GPUs of a node, R replicas across nodes): the gathers and the
     reduce-scatter ride NVLink; each of the node's g GPUs all-reduces its r P / s gradient shard over
     the R nodes, the g rings sharing the node's NICs: g x 2 (R - 1) / R x r P / s;
   - FSDP within one node: nothing.

   Times the micro-batches of a step (every one reduces: no `no_sync`). At the reading's bus bandwidth
   (NCCL_NETWORK_BUSBW_SHARE of the node's NIC line rate, as conf/node's presets carry it), with no
   latency (so the time is a floor), these bytes must fit within the published step (tokens per GPU
   per step / published tokens/s per GPU) even if overlap hid every byte under compute; if not, the run
   could not have reached its throughput on that network, and the reading is ruled out as too slow.
2. **The network fits through the GPUs' links.** An SXM GPU reaches a NIC only over its PCIe link
   (GPUDirect RDMA reads GPU memory across it; staging through host memory crosses it too), so a
   node's NICs can carry at most g times one link's per-direction line rate (the presets'
   `link.*_theoretical_bytes_per_s`: A100 PCIe 4.0 x16 31.5 GB/s, H100 5.0 x16 63 GB/s). A reading
   implying more NIC rate per GPU describes a node that cannot feed it: ruled out as too fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.calibration_rows import (
    INDEPENDENT_ROWS,
    INDEPENDENT_SOURCES,
    LLAMA_SHAPES,
    NCCL_NETWORK_BUSBW_SHARE,
    NETWORK_READINGS,
)
from benchmarks.common import conf


@dataclass(frozen=True)
class ReadingCheck:
    """One network reading of one published row, against the two bounds (module docstring)."""

    reading: str
    #: The node's NICs together, per direction, under this reading.
    node_line_bytes_per_s: float
    #: Bus bytes each node's NICs carry per optimizer step (`network_bytes_per_step`).
    bus_bytes: float
    #: The published step: tokens per GPU per step / published tokens/s per GPU.
    step_s: float
    #: One GPU's PCIe link, per direction (line rate).
    link_bytes_per_s: float
    gpus_per_node: int
    busbw_share: float = NCCL_NETWORK_BUSBW_SHARE

    @property
    def collectives_s(self) -> float:
        """The step's inter-node collectives at the reading's bus bandwidth, latency left out."""
        return self.bus_bytes / (self.busbw_share * self.node_line_bytes_per_s)

    @property
    def fits_step(self) -> bool:
        return self.collectives_s <= self.step_s

    @property
    def fits_links(self) -> bool:
        return self.node_line_bytes_per_s <= self.gpus_per_node * self.link_bytes_per_s

    @property
    def allowed(self) -> bool:
        return self.fits_step and self.fits_links

    def describe(self) -> str:
        verdict = "allowed" if self.allowed else "ruled out: " + " and ".join(
            why for ok, why in ((self.fits_step, "collectives outlast the step"),
                                (self.fits_links, "more than the GPUs' PCIe links carry")) if not ok)
        per_gpu = self.node_line_bytes_per_s / self.gpus_per_node
        return (f"{self.reading} ({self.node_line_bytes_per_s * 8 / 1e9:,.0f} Gb/s a node): "
                f"{self.bus_bytes / 1e9:.1f} GB a step through each node's NICs, {self.collectives_s:.2f} s at "
                f"busbw {self.busbw_share * self.node_line_bytes_per_s / 1e9:.1f} GB/s = "
                f"{self.collectives_s / self.step_s:.2f} of the published {self.step_s:.2f} s step; "
                f"{per_gpu / 1e9:.2f} GB/s of NIC per GPU, its PCIe link {self.link_bytes_per_s / 1e9:.1f}: {verdict}")


def network_bytes_per_step(num_params: int, sharding: str, gpus: int, shards: int, gpus_per_node: int,
                           grad_reduce_bytes: int, param_bytes: int = 2, micro_batches: int = 1) -> float:
    """Bus bytes each node's NICs carry per optimizer step of FSDP `sharding` (module docstring, 1)."""
    if sharding == "HYBRID_SHARD":
        replicas = gpus // shards
        if shards > gpus_per_node or replicas == 1:
            raise ValueError(f"HYBRID_SHARD: {shards}-GPU shard groups on {gpus_per_node}-GPU nodes, {gpus} GPUs")
        per_micro = gpus_per_node * 2 * (replicas - 1) / replicas * grad_reduce_bytes * num_params / shards
    elif sharding == "FULL_SHARD":
        if shards <= gpus_per_node:
            return 0.0
        per_micro = (2 * param_bytes + grad_reduce_bytes) * num_params * (shards - 1) / shards
    else:
        raise ValueError(f"sharding {sharding!r}: FULL_SHARD or HYBRID_SHARD")
    return micro_batches * per_micro


def llama_params(shape: str) -> int:
    """Parameters of a Llama shape (LLAMA_SHAPES): untied embedding and head, q/k/v/o projections (k
    and v at the kv heads' width), the gated MLP's three matrices and two RMSNorms per layer, one final
    RMSNorm; no biases. The analytic graph's count (tests/test_calibration_network.py holds them equal)."""
    layers, h, heads, kv, ffn, vocab = LLAMA_SHAPES[shape]
    per_layer = 2 * h * h + 2 * h * (h // heads * kv) + 3 * h * ffn + 2 * h
    return 2 * vocab * h + layers * per_layer + h


def independent_checks(presets: dict[str, str]) -> list[tuple[tuple, list[ReadingCheck]]]:
    """Every independent row (INDEPENDENT_ROWS) with its readings' checks: the source's two readings
    where NETWORK_READINGS lists them, else the network the row is modelled on (its node preset with the
    source's overrides). `presets`: GPU -> hardware preset (benchmarks/calibration.py, PRESETS)."""
    out = []
    for row in INDEPENDENT_ROWS:
        key, _line, _text, shape, seq, gpus, mb, _ckpt, sharding, tokens = row
        _family, gpu, node_name, overrides, reduce_bytes, _source, _api = INDEPENDENT_SOURCES[key]
        node = conf("node", node_name) | dict(overrides)
        link = conf("hardware", presets[gpu])["link"]
        link_bytes = min(link["h2d_theoretical_bytes_per_s"], link["d2h_theoretical_bytes_per_s"])
        per_node = node["gpus_per_node"]
        shards = per_node if sharding == "HYBRID_SHARD" else gpus
        bus = network_bytes_per_step(llama_params(shape), sharding, gpus, shards, per_node, reduce_bytes)
        readings = NETWORK_READINGS.get(key, (("as modelled", node["nics_per_node"] * node["nic_bytes_per_s"]),))
        out.append((row, [ReadingCheck(name, line_rate, bus, mb * seq / tokens, link_bytes, per_node)
                          for name, line_rate in readings]))
    return out


def network_lines(presets: dict[str, str]) -> list[str]:
    """The check, one printed line per independent row and reading (benchmarks/calibration.py)."""
    return [f"network  {row[0]} line {row[1]} ({row[3]}, {row[5]} GPUs, {row[8]}): {check.describe()}"
            for row, checks in independent_checks(presets) for check in checks]
