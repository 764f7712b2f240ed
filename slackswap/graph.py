"""The op graph of one training step: ops in execution order and the tensors between them.

Only activation-like tensors are graph tensors (forward activations, dropout masks, softmax
statistics, activation gradients, logits, loss). Weights, weight gradients and optimizer state are
not: they are reported (`Graph.weight_bytes` etc.) but not counted against the activation budget.

Memory semantics the simulator relies on:
- an op allocates all of its `outputs` when it starts;
- a tensor is freed when the last op that reads it has finished (and, if it is being offloaded, when
  that offload has finished too);
- a tensor is `saved` when at least one backward op reads it: those are the activations a plan must
  decide to keep, swap or recompute.
- an activation gradient that receives several contributions (a residual branch) is produced by the
  first backward op that writes it; later contributors list it as an input (they accumulate into it
  in place), and the backward op of the tensor's forward producer is its last reader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from types import MappingProxyType


class Phase(StrEnum):
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class OpClass(StrEnum):
    """Roofline efficiency classes; values match `hardware.efficiency` keys."""

    MATMUL = "matmul"
    ATTENTION = "attention"
    ELEMENTWISE = "elementwise"


#: Phases whose ops run before backward: their outputs are the activations a plan may drop, and their
#: readers of a saved tensor are its "forward readers".
FORWARD_PHASES: frozenset[Phase] = frozenset({Phase.FORWARD, Phase.LOSS})

#: `layer` value of ops/tensors outside the transformer stack (embeddings, LM head, loss).
NO_LAYER = -1


@dataclass(frozen=True)
class Tensor:
    name: str
    size_bytes: int
    producer: str
    consumers: tuple[str, ...]
    layer: int
    saved: bool
    #: Free-form role tag for reports (for example "softmax_out", "dropout_mask", "grad").
    role: str = ""


@dataclass(frozen=True)
class Op:
    name: str
    phase: Phase
    op_class: OpClass
    layer: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flops: float
    moved_bytes: int
    duration_s: float
    #: For backward ops: the forward op they differentiate. Empty otherwise.
    forward_op: str = ""
    #: Free-form role tag (for example "qkv", "softmax", "fc1_bwd").
    role: str = ""


@dataclass(frozen=True)
class Graph:
    """Ops in keep-all execution order (forward, loss, backward, optional optimizer) plus tensors."""

    name: str
    ops: tuple[Op, ...]
    tensors: Mapping[str, Tensor]
    num_layers: int
    weight_bytes: int = 0
    weight_grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    #: Shape and hardware the graph was built from, for exports and reports.
    meta: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))
        check_graph(self.ops, self.tensors)

    @cached_property
    def op_by_name(self) -> Mapping[str, Op]:
        return MappingProxyType({op.name: op for op in self.ops})

    @cached_property
    def op_index(self) -> Mapping[str, int]:
        return MappingProxyType({op.name: i for i, op in enumerate(self.ops)})

    @cached_property
    def distinct_inputs(self) -> Mapping[str, tuple[str, ...]]:
        """Op name -> its inputs without repeats, in order (what a step reads: one copy per tensor).
        Cached because plan validation and the simulator look it up for every step of every plan."""
        return MappingProxyType({op.name: tuple(dict.fromkeys(op.inputs)) for op in self.ops})

    @cached_property
    def size_bytes_of(self) -> Mapping[str, int]:
        """Tensor name -> bytes, cached for the same reason as `distinct_inputs`."""
        return MappingProxyType({name: t.size_bytes for name, t in self.tensors.items()})

    @cached_property
    def saved_tensors(self) -> tuple[Tensor, ...]:
        """Saved activations in production order."""
        return tuple(
            self.tensors[t] for op in self.ops for t in op.outputs if self.tensors[t].saved
        )

    @cached_property
    def forward_ops(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.phase in FORWARD_PHASES)

    @cached_property
    def backward_ops(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.phase == Phase.BACKWARD)

    def layer_ops(self, layer: int, phase: Phase | None = None) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.layer == layer and (phase is None or op.phase == phase))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return (
            self.name == other.name
            and self.ops == other.ops
            and dict(self.tensors) == dict(other.tensors)
            and self.num_layers == other.num_layers
            and self.weight_bytes == other.weight_bytes
            and self.weight_grad_bytes == other.weight_grad_bytes
            and self.optimizer_state_bytes == other.optimizer_state_bytes
            and dict(self.meta) == dict(other.meta)
        )

    __hash__ = None  # type: ignore[assignment]


def check_graph(ops: Iterable[Op], tensors: Mapping[str, Tensor]) -> None:
    """Structural checks: every tensor has one producer that runs before all of its consumers."""
    from slackswap.errors import SlackSwapError

    position: dict[str, int] = {}
    for i, op in enumerate(ops):
        if op.name in position:
            raise SlackSwapError(f"graph: duplicate op name {op.name!r}")
        position[op.name] = i
        if op.duration_s < 0:
            raise SlackSwapError(f"graph: op {op.name!r} has negative duration_s={op.duration_s}")
    for name, tensor in tensors.items():
        if name != tensor.name:
            raise SlackSwapError(f"graph: tensor key {name!r} != tensor.name {tensor.name!r}")
        if tensor.size_bytes < 0:
            raise SlackSwapError(f"graph: tensor {name!r} has negative size_bytes={tensor.size_bytes}")
        if tensor.producer not in position:
            raise SlackSwapError(f"graph: tensor {name!r} has unknown producer {tensor.producer!r}")
        for consumer in tensor.consumers:
            if consumer not in position:
                raise SlackSwapError(f"graph: tensor {name!r} has unknown consumer {consumer!r}")
            if position[consumer] <= position[tensor.producer]:
                raise SlackSwapError(
                    f"graph: tensor {name!r} is read by {consumer!r} before its producer {tensor.producer!r}"
                )
    for op in ops:
        for t in op.inputs:
            if t not in tensors:
                raise SlackSwapError(f"graph: op {op.name!r} reads unknown tensor {t!r}")
            if op.name not in tensors[t].consumers:
                raise SlackSwapError(f"graph: op {op.name!r} reads {t!r} but is not among its consumers")
        for t in op.outputs:
            if t not in tensors or tensors[t].producer != op.name:
                raise SlackSwapError(f"graph: op {op.name!r} output {t!r} does not name it as producer")
