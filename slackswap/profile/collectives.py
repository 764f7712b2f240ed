"""The collectives a parallel layout adds inside one rank's step, and their time on the node's links.

The profile records them while it builds a rank's graph (`slackswap.profile.layers`), one per
tensor-parallel region boundary or ring exchange, in execution order. They are not graph ops: `price`
times them and says how much of that time the step waits on (`exposed_s`), which the run adds to its
simulated step (`slackswap.experiment.run`) and advise to each stage's forward and backward.

Overlap rule. Tensor-parallel (and expert all-to-all) collectives are exposed in full: Megatron-LM's
f / g operators run the collective inside the autograd function, between the GEMM that produces its
buffer and the one that consumes it, so the next op waits for it (Shoeybi et al. 2019, section 3;
Narayanan et al. 2021, arXiv 2104.04473, section 3.2: tensor-parallel all-reduces are paid in every
layer's forward and backward, which is why tp stays inside a node; Korthikanti et al. 2022,
arXiv 2205.05198, section 4.2.2: sp replaces each all-reduce by a reduce-scatter + all-gather pair of
the same volume, still in line). Megatron-Core's `tp_comm_overlap` (userbuffers GEMM overlap) is an
opt-in not modelled here. Context-parallel ring exchanges overlap the attention they feed: each ring
step sends the next K, V block while the current block's attention runs (Liu et al. 2023, arXiv
2310.01889, section 3; Megatron-Core / Transformer Engine ring attention), so per layer and phase only
the ring time beyond that layer's attention compute in that phase (the graph's `attention_core` ops)
is exposed. Megatron's
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

Not here: data-parallel gradient collectives (ZeRO / DDP over the dp x cp ranks that hold the
same dense parameters, `ParallelConfig.dp_cp`), which `slackswap.communication.step_communication`
prices, so nothing is counted twice; pipeline sends; the transient full-sequence buffers an
all-gather writes (not graph tensors).
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
    #: The part of forward_s / backward_s the step waits on (module docstring, overlap rule); None unpriced.
    forward_exposed_s: float | None = None
    backward_exposed_s: float | None = None

    @property
    def bus_bytes(self) -> float:
        return self.forward_bus_bytes + self.backward_bus_bytes

    @property
    def total_s(self) -> float | None:
        return None if self.forward_s is None or self.backward_s is None else self.forward_s + self.backward_s

    @property
    def exposed_s(self) -> float | None:
        """Seconds per micro-batch the step waits on these collectives (None when unpriced)."""
        if self.forward_exposed_s is None or self.backward_exposed_s is None:
            return None
        return self.forward_exposed_s + self.backward_exposed_s

    @property
    def hidden_s(self) -> float | None:
        """Ring time hidden behind attention compute (context parallelism's overlap)."""
        total, exposed = self.total_s, self.exposed_s
        return None if total is None or exposed is None else total - exposed


def group_strides(parallel) -> dict[str, int]:
    """GPU distance between neighbours of each group in Megatron-Core's rank order (tp fastest, then cp;
    the expert layers' order tp-ep-dp puts ep right after tp)."""
    return {"tp": 1, "cp": parallel.tp, "ep": parallel.tp}


def attention_compute_s(graph) -> dict[tuple[int, str], float]:
    """Seconds of attention-core compute per (layer, phase) of `graph`: what a ring exchange hides behind."""
    out: dict[tuple[int, str], float] = {}
    for op in graph.ops:
        if op.attention_core:
            key = (op.layer, str(op.phase))
            out[key] = out.get(key, 0.0) + op.duration_s
    return out


def price(collectives: Sequence[Collective], parallel, topology: Topology | None,
          node_name: str = "", graph=None) -> LayoutCommunication:
    """Sum `collectives` per phase and time them on `topology`'s fabrics (the tp group on NVLink while
    it stays in one node; a group that leaves it at its share of the node's NICs, every group of its
    kind running the same collective at once: `Topology.network_share`). No topology, or a group the
    node cannot hold: bytes only, `unpriced` says why.
    The exposed time follows the module docstring's overlap rule, ring exchanges hidden behind `graph`'s
    attention compute of their layer and phase (no `graph`: nothing hidden)."""
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
    exposed = _exposed_s(collectives, fabrics, {} if graph is None else attention_compute_s(graph))
    return LayoutCommunication(len(collectives), fwd, bwd, times["forward"], times["backward"],
                               {g: f.name for g, f in fabrics.items()}, "", exposed["forward"], exposed["backward"])


def _exposed_s(collectives: Sequence[Collective], fabrics: Mapping[str, Any],
               attention_s: Mapping[tuple[int, str], float]) -> dict[str, float]:
    """Per phase, the seconds the step waits on: every collective but a ring exchange in full, a layer's
    ring exchanges of one phase beyond that layer's attention compute in it (module docstring)."""
    out = dict.fromkeys(PHASES, 0.0)
    rings: dict[tuple[int, str], float] = {}
    for c in collectives:
        t = c.time_s(fabrics[c.group])
        if c.kind == "ring_exchange":
            rings[(c.layer, c.phase)] = rings.get((c.layer, c.phase), 0.0) + t
        else:
            out[c.phase] += t
    for (layer, phase), t in rings.items():
        out[phase] += max(0.0, t - attention_s.get((layer, phase), 0.0))
    return out


def to_json(collectives: Iterable[Collective]) -> list[dict[str, Any]]:
    return [asdict(c) for c in collectives]


def from_json(rows: Iterable[Mapping[str, Any]]) -> list[Collective]:
    return [Collective(**dict(r)) for r in rows]


def per_layer_bus_bytes(collectives: Iterable[Collective]) -> dict[int, float]:
    out: dict[int, float] = {}
    for c in collectives:
        out[c.layer] = out.get(c.layer, 0.0) + c.bus_bytes
    return out
