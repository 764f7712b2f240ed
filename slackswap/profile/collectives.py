"""The collectives a parallel layout adds inside one rank's step, and their time on the node's links.

The profile records them while it builds a rank's graph (`slackswap.profile.layers`), one per
tensor-parallel region boundary or ring exchange, in execution order; they are not graph ops (the
simulated step does not wait on them: `LayoutCommunication` reports their time beside it). Megatron's
conjugate operators (Shoeybi et al. 2019, section 3; Korthikanti et al. 2022, section 4.2.2):

- f, into column-parallel GEMMs (QKV, fc1 / gate+up, LM head): without sp, forward nothing and
  backward an all-reduce of the input gradient; with sp, forward an all-gather of the sequence
  shards, backward a reduce-scatter of the input gradient plus an all-gather that re-gathers the
  saved sequence shard for the weight gradient (Megatron's sequence-parallel linear backward).
- g, out of row-parallel GEMMs (projection, fc2 / down) and the vocab-parallel embedding: without
  sp, forward an all-reduce of the partial sums, backward nothing; with sp, forward a
  reduce-scatter, backward an all-gather.

Sizes are the bytes of the full (unsharded) buffer, as nccl-tests and `slackswap.communication` count
them; a reduce-scatter plus an all-gather moves what one all-reduce moves (Korthikanti et al. 2022:
sequence parallelism adds no communication). Vocab-parallel cross entropy all-reduces three fp32
values per token in forward (max logit, target logit, sum of exponentials; Megatron's
`_VocabParallelCrossEntropy`). Context parallelism passes K and V around a ring of cp ranks in forward
(cp - 1 steps) and K, V and their gradients in backward (Megatron-Core / Transformer Engine ring
attention), priced as a ring all-gather of the cp shards, which has the same steps and bytes.
Expert parallelism adds four all-to-alls per MoE layer over the ep group (dispatch and combine in
forward, their gradients in backward; GShard, Lepikhin et al. 2020; Megatron-Core's alltoall token
dispatcher), each of this rank's T k routed token rows (`slackswap.profile.moe`).

Not here: data-parallel gradient collectives (ZeRO / DDP over dp, and over dp * cp under context
parallelism), which `slackswap.communication.step_communication` prices, so nothing is counted twice;
pipeline sends; the transient full-sequence buffers an all-gather writes (not graph tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from slackswap.communication import Topology, all_gather_s, all_reduce_s, reduce_scatter_s
from slackswap.errors import ConfigError

KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "ring_exchange", "all_to_all")
PHASES: tuple[str, ...] = ("forward", "backward")


@dataclass(frozen=True)
class Collective:
    """One collective this rank joins in one phase of the step."""

    name: str
    layer: int
    phase: str
    kind: str
    #: The parallel group: "tp", "cp" or "ep".
    group: str
    ranks: int
    #: Bytes of the full (unsharded) buffer; for an all-to-all, this rank's send buffer.
    size_bytes: int
    why: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("collective.kind", self.kind, f"must be one of {KINDS}")
        if self.phase not in PHASES:
            raise ConfigError("collective.phase", self.phase, f"must be one of {PHASES}")

    @property
    def bus_bytes(self) -> float:
        """Bytes this rank sends (= receives) on the ring: 2 S (n-1)/n for an all-reduce, S (n-1)/n else."""
        share = (self.ranks - 1) / self.ranks
        return (2 if self.kind == "all_reduce" else 1) * self.size_bytes * share

    def time_s(self, fabric) -> float:
        """Alpha-beta ring time on `fabric` (`slackswap.communication`, model 1)."""
        if self.kind == "all_reduce":
            return all_reduce_s(self.size_bytes, self.ranks, fabric)
        if self.kind == "reduce_scatter":
            return reduce_scatter_s(self.size_bytes, self.ranks, fabric)
        # All-gather and the ring exchange; an all-to-all as n - 1 pairwise exchanges of S / n each, which
        # has the all-gather's steps and bytes on a switched fabric (NVSwitch, a fat-tree network).
        return all_gather_s(self.size_bytes, self.ranks, fabric)


@dataclass(frozen=True)
class LayoutCommunication:
    """One rank's layout collectives per step: counts, bus bytes and ring time per phase."""

    count: int
    forward_bus_bytes: float
    backward_bus_bytes: float
    #: None when the node cannot hold the group (`unpriced` says why).
    forward_s: float | None
    backward_s: float | None
    fabrics: Mapping[str, str]
    unpriced: str = ""

    @property
    def bus_bytes(self) -> float:
        return self.forward_bus_bytes + self.backward_bus_bytes

    @property
    def total_s(self) -> float | None:
        return None if self.forward_s is None or self.backward_s is None else self.forward_s + self.backward_s


def group_strides(parallel) -> dict[str, int]:
    """GPU distance between neighbours of each group in Megatron-Core's rank order (tp fastest, then cp;
    the expert layers' order tp-ep-dp puts ep right after tp)."""
    return {"tp": 1, "cp": parallel.tp, "ep": parallel.tp}


def price(collectives: Sequence[Collective], parallel, topology: Topology | None,
          node_name: str = "") -> LayoutCommunication:
    """Sum `collectives` per phase and time them on `topology`'s fabrics (the tp group on NVLink while
    it stays in one node). No topology, or a group the node cannot hold: bytes only, `unpriced` says why."""
    fwd = sum(c.bus_bytes for c in collectives if c.phase == "forward")
    bwd = sum(c.bus_bytes for c in collectives if c.phase == "backward")
    groups = {c.group: c.ranks for c in collectives}
    fabrics, unpriced = {}, ""
    if topology is None:
        unpriced = "no node given"
    else:
        strides = group_strides(parallel)
        for group, ranks in sorted(groups.items()):
            span = (ranks - 1) * strides[group] + 1
            if span > topology.gpus_per_node and topology.inter_node is None:
                unpriced = (f"parallel.{group}={ranks} spans {span} GPUs; node {node_name or '?'} has "
                            f"{topology.gpus_per_node} and no network")
                break
            fabrics[group] = topology.fabric_for(ranks, stride=strides[group])
    if unpriced:
        return LayoutCommunication(len(collectives), fwd, bwd, None, None, {}, unpriced)
    times = {p: sum(c.time_s(fabrics[c.group]) for c in collectives if c.phase == p) for p in PHASES}
    return LayoutCommunication(len(collectives), fwd, bwd, times["forward"], times["backward"],
                               {g: f.name for g, f in fabrics.items()})


def to_json(collectives: Iterable[Collective]) -> list[dict[str, Any]]:
    return [asdict(c) for c in collectives]


def from_json(rows: Iterable[Mapping[str, Any]]) -> list[Collective]:
    return [Collective(**dict(r)) for r in rows]


def per_layer_bus_bytes(collectives: Iterable[Collective]) -> dict[int, float]:
    out: dict[int, float] = {}
    for c in collectives:
        out[c.layer] = out.get(c.layer, 0.0) + c.bus_bytes
    return out
