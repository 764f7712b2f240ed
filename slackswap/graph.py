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

What real (traced) programs add, with defaults that leave the analytic graphs as they were:
- **views / aliases** (`Tensor.base`): a tensor may share the storage of another tensor, its base,
  which its producer reads (a view: q/k/v split out of one qkv output, a reshape; or the result of
  an in-place op). Bytes are counted once per storage: a device copy of an alias made by a run or
  recompute step allocates nothing and keeps the storage of the base copy it was made from alive,
  so a storage is freed when its last alias dies. A prefetched alias is a fresh storage of its own
  `size_bytes` (what the offload copied).
- **in-place writes** (`Op.writes`): inputs the op overwrites. Each written tensor has an output of
  the op that aliases it (the new version, `base` = the written tensor); no op after the writer may
  read the old version, and no recompute step after it either (the plan validator enforces it).
- **random ops** (`Op.random`, dropout): a recompute of a random op replays the RNG state the op
  used in forward (as PyTorch's checkpoint does with preserve_rng_state), so it draws the same mask.
  Its cost: `RNG_STATE_BYTES` stashed on the device from the op's run step to its last recompute,
  the op's time again, and every output of the op allocated for the recompute step (the mask is
  regenerated even when only the dropped output is wanted; outputs not materialised are freed when
  the step ends). docs/simulation.md section 4 states it; the simulator and the planners' replay
  share it through `slackswap.schedule.copies`.
- **the model's own references** (`Tensor.held_until`): eager code keeps a tensor alive while a
  Python variable of the model refers to it (HF's attention keeps `attn_weights` until the block
  returns), whatever autograd or a plan does. A run copy of such a tensor is freed no earlier than
  the end of the run step of `held_until` (and a storage lives while any alias of it is held). The
  copy resolver folds it into each copy's last use (`slackswap.schedule.copies`), so the simulator,
  the replays and every planner that checks its plans with them honour it. Analytic graphs have no
  holds.
- **layers** (`Op.layer`, `Tensor.layer`): the index of the repeated block (transformer layer) an op
  or tensor belongs to, `NO_LAYER` outside the stack. Layer-based planners (full_recompute,
  swap_only, selective_recompute) read it, and selective_recompute reads `Op.attention_core`; no
  planner reads the free-form `role` tags, so a traced graph needs no analytic vocabulary.
- **phase order**: all forward and loss ops come before every backward op, and optimizer ops come
  last; `check_graph` enforces it (build_schedule relies on it).
- **checkpoint candidates** (`Graph.candidate_tensors`): `Tensor.saved` is what autograd saves (a
  backward op reads it); every other forward tensor with its own storage that no op overwrites in
  place is a *candidate*: a plan may also keep or swap it as an extra checkpoint (what PyTorch's
  selective checkpointing and torch.compile's partitioner do), so a recompute chain stops there and
  the kept copy lives until its last recompute reader. A candidate with no decision is what it always
  was: freed after its last forward reader, regenerated when a recompute chain needs it. Deciding
  candidates is optional, so the analytic graphs, the fingerprints and every plan that decides only
  saved tensors are unchanged.
- **fingerprint** (`Graph.fingerprint`): a hash of the ops, tensors and sizes (not the timings). A
  plan records the fingerprint of the graph it was made for, and the validator refuses a plan made
  for another graph (`GraphMismatchError`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from types import MappingProxyType
from typing import Generic, TypeVar


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

#: Device bytes a random op's RNG state takes while it is stashed for a replay: the CUDA Philox
#: generator's seed and offset, two 64-bit integers (what torch.cuda.get_rng_state() returns for
#: the default generator is this state, 16 bytes).
RNG_STATE_BYTES = 16

#: Graph meta of a captured graph (`slackswap.runtime.capture`): forward tensor -> [the op that writes it
#: in place after its producer, the model line], and forward op -> [module state it writes in place, the
#: line]; what `slackswap.planners.support.replay_rule` reads (a recompute replays the producer only).
REWRITTEN_KEY = "rewritten_in_place"
STATE_KEY = "writes_module_state"
#: Graph meta of a captured graph: backward op -> the layers whose ops saved the tensors autograd unpacked
#: for it (the checkpoint regions whose eager frames that unpack would re-run; `slackswap.pytorch_execution`).
BACKWARD_FRAMES_KEY = "backward_frames"
#: Graph meta of a captured graph: forward tensor -> the layers it was passed to as an argument (positional
#: or keyword, a view of it included). A checkpoint frame keeps its layer's arguments for the replay until
#: the frame dies, also one no op of the layer reads (HF Llama's `cache_position`; `slackswap.pytorch_execution`).
LAYER_ARGUMENTS_KEY = "layer_arguments"
#: Graph meta of a captured graph: per layer (index), the saved-tensor pack events of its forward, weights and
#: tensors saved twice included: what the layer's eager checkpoint frame packs (`slackswap.experiment
#: .measured_executor.export_counts`).
SAVED_PACKS_BY_LAYER_KEY = "saved_tensor_packs_by_layer"
#: Graph meta of a captured graph: per graph tensor autograd saves, [its pack events, its unpack events]
#: (tensors saved twice or read back twice count twice; weights and inputs are no graph tensor): which
#: of the step's hook events are those of the tensors a plan recomputes (`saved_tensor_events`, priced
#: apart by `slackswap.experiment.prediction`).
SAVED_EVENTS_BY_TENSOR_KEY = "saved_tensor_events_by_tensor"
#: Graph meta of a captured graph: the calls of modules without children in the step, forward and
#: backward: what a recomputing plan's hook-only step checks one by one (`slackswap.runtime.eager
#: .module_calls`), priced per call by `slackswap.experiment.prediction`.
LEAF_MODULE_CALLS_KEY = "leaf_module_calls"
#: Graph meta of a captured graph: each parameter's gradient storage the step made, name -> bytes. A
#: weight gradient is model state (`Graph.weight_grad_bytes`), not an activation, in every graph source
#: (docs/memory.md); the capture lists them so the runtime can tell them from a tensor the graph lacks.
WEIGHT_GRADS_KEY = "weight_gradients"

#: ATen ops (overload packets, an op's `role`) through which a tensor made from Python data inside
#: forward (`torch.tensor(...)`, the index tensor of `x[..., [-2], :]`) enters the dispatcher. The
#: torch identities name their output (`slackswap.profile.torch.identity`); a recompute of it would
#: replay the call from the very tensor it frees, so `replay_rule` keeps such a tensor when saved.
PYTHON_CONSTANT_OPS = frozenset({"lift_fresh"})

#: Phase order `check_graph` enforces: forward and loss ops, then backward, then optimizer.
_PHASE_RANK = {Phase.FORWARD: 0, Phase.LOSS: 0, Phase.BACKWARD: 1, Phase.OPTIMIZER: 2}


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
    #: The tensor whose storage this one shares (a view, or the new version an in-place op writes);
    #: "" for a tensor with its own storage. See the module docstring.
    base: str = ""
    #: The op after which the model's own code (its Python variables) drops its last reference to the
    #: tensor in eager execution; "" when nothing holds it beyond its readers. See the module docstring.
    held_until: str = ""


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
    #: Free-form role tag for reports (for example "qkv", "softmax", "fc1_bwd"); planners never read it.
    role: str = ""
    #: The op draws random numbers (dropout); a recompute replays its RNG state (module docstring).
    random: bool = False
    #: Inputs the op overwrites in place (module docstring).
    writes: tuple[str, ...] = ()
    #: The op lies inside the attention core (scores, softmax, its dropout, the PV product, or a fused
    #: attention kernel): what selective recompute drops and regenerates.
    attention_core: bool = False


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
    def has_aliases(self) -> bool:
        """Whether any tensor shares a storage or any op writes in place (the plan walk skips that
        bookkeeping for the analytic graphs, which have neither)."""
        return any(t.base for t in self.tensors.values()) or any(op.writes for op in self.ops)

    @cached_property
    def has_holds(self) -> bool:
        """Whether any tensor is held by the model's code beyond its readers (`Tensor.held_until`)."""
        return any(t.held_until for t in self.tensors.values())

    @cached_property
    def size_bytes_of(self) -> Mapping[str, int]:
        """Tensor name -> bytes, cached for the same reason as `distinct_inputs`."""
        return MappingProxyType({name: t.size_bytes for name, t in self.tensors.items()})

    @cached_property
    def op_duration_s(self) -> Mapping[str, float]:
        """Op name -> `duration_s`: the simulator, the replay and the schedule builder look it up for every
        step of every plan, one lookup instead of the op record and its attribute."""
        return MappingProxyType({op.name: op.duration_s for op in self.ops})

    @cached_property
    def _memos(self) -> dict[GraphMemo, object]:
        """The values of the `GraphMemo`s computed for this graph, keyed by the memo."""
        return {}

    @cached_property
    def saved_tensors(self) -> tuple[Tensor, ...]:
        """Saved activations in production order."""
        return tuple(
            self.tensors[t] for op in self.ops for t in op.outputs if self.tensors[t].saved
        )

    @cached_property
    def candidate_tensors(self) -> tuple[Tensor, ...]:
        """Forward tensors autograd does not save that a plan may keep or swap as extra checkpoints
        (module docstring), in production order: own storage (not an alias) and never overwritten in
        place (a copy kept past the writer would hold the new version, not this one)."""
        written = {t for op in self.ops if op.writes for t in op.writes}
        return tuple(
            self.tensors[t]
            for op in self.ops
            if op.phase in FORWARD_PHASES
            for t in op.outputs
            if not self.tensors[t].saved and not self.tensors[t].base and t not in written
        )

    @cached_property
    def candidate_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.candidate_tensors)

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the ops (names, phases, inputs, outputs, random / in-place flags) and tensors (names,
        sizes, producers, consumers, bases): what a plan's validity depends on, not the timings."""
        payload = {
            "ops": [[op.name, op.phase.value, op.inputs, op.outputs, op.forward_op, op.random, op.writes]
                    for op in self.ops],
            # A hold changes when a copy can be freed; a graph without holds hashes as before.
            "tensors": sorted([t.name, t.size_bytes, t.producer, t.consumers, t.saved, t.base,
                               *([t.held_until] if t.held_until else [])]
                              for t in self.tensors.values()),
        }
        return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()[:16]

    @cached_property
    def drop_bytes_of(self) -> Mapping[str, int]:
        """Saved tensor -> the device bytes dropping it (swap or recompute) can give back: its own
        storage; for an alias, the whole storage it keeps alive when it is the only saved tensor in
        that storage (CPU dropout's noise: the last in-place version of an `empty_like` storage, whose
        earlier versions nothing saves), else its own `size_bytes` (one of several saved views).
        Planners value a tensor by it (`slackswap.planners.support.analysis`); `owned_bytes` would give
        an alias 0."""
        saved_in: dict[str, int] = {}
        roots = {t.name: self.storage_root(t.name) for t in self.saved_tensors}
        for root in roots.values():
            saved_in[root] = saved_in.get(root, 0) + 1
        return MappingProxyType({
            name: self.tensors[root].size_bytes if saved_in[root] == 1 else self.tensors[name].size_bytes
            for name, root in roots.items()
        })

    def owned_bytes(self, name: str) -> int:
        """Device bytes a copy of `name` made by a step owns: 0 for an alias (it shares its base's storage)."""
        tensor = self.tensors[name]
        return 0 if tensor.base else tensor.size_bytes

    def storage_root(self, name: str) -> str:
        """The tensor that owns the storage `name` lives in (itself unless it is an alias)."""
        while self.tensors[name].base:
            name = self.tensors[name].base
        return name

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


T = TypeVar("T")


class GraphMemo(Generic[T]):
    """A table derived from a graph by one function, computed on first use and kept with the graph.

    Declared at module level by the module that owns the table (`_TABLES = GraphMemo(build_tables)`, then
    `_TABLES(graph)`): the table stays private to that module, and the graph only holds its value, keyed
    by the memo object, in `Graph._memos`. A Graph is frozen, so a derived table cannot go stale."""

    __slots__ = ("build",)

    def __init__(self, build: Callable[[Graph], T]) -> None:
        self.build = build

    def __call__(self, graph: Graph) -> T:
        memos = graph._memos
        try:
            return memos[self]  # type: ignore[return-value]
        except KeyError:
            value = memos[self] = self.build(graph)
            return value

    def __repr__(self) -> str:
        return f"GraphMemo({self.build.__module__}.{self.build.__qualname__})"


def saved_tensor_events(graph: Graph, tensors: Iterable[str]) -> int:
    """Saved-tensor events (packs and unpacks) of `tensors`, by the capture's split
    (`SAVED_EVENTS_BY_TENSOR_KEY`). A graph with events but without their split (captured before the
    capture counted them) is a ValueError naming the key: its events cannot be told apart."""
    events = int(graph.meta.get("saved_tensor_packs", 0)) + int(graph.meta.get("saved_tensor_unpacks", 0))
    by_tensor = graph.meta.get(SAVED_EVENTS_BY_TENSOR_KEY)
    if by_tensor is None:
        if events:
            raise ValueError(f"graph {graph.name!r}: meta {SAVED_EVENTS_BY_TENSOR_KEY!r} missing (its {events} "
                             "saved-tensor events are not split by tensor): capture it again")
        return 0
    return sum(sum(by_tensor.get(name, (0, 0))) for name in set(tensors))


def check_graph(ops: Iterable[Op], tensors: Mapping[str, Tensor]) -> None:
    """Structural checks: every tensor has one producer that runs before all of its consumers; the
    phase order; aliases read by their producer; in-place writes with no reader of the old version."""
    from slackswap.errors import SlackSwapError

    ops = tuple(ops)
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
    highest_phase: Op | None = None
    for op in ops:
        if highest_phase is not None and _PHASE_RANK[op.phase] < _PHASE_RANK[highest_phase.phase]:
            raise SlackSwapError(
                f"graph: {op.phase.value} op {op.name!r} comes after {highest_phase.phase.value} op "
                f"{highest_phase.name!r}; ops must be ordered forward/loss, then backward, then optimizer"
            )
        if highest_phase is None or _PHASE_RANK[op.phase] > _PHASE_RANK[highest_phase.phase]:
            highest_phase = op
    _check_aliases(ops, tensors, position)


def _check_aliases(ops: tuple[Op, ...], tensors: Mapping[str, Tensor], position: Mapping[str, int]) -> None:
    from slackswap.errors import SlackSwapError

    for name, tensor in tensors.items():
        if not tensor.base:
            continue
        if tensor.base not in tensors:
            raise SlackSwapError(f"graph: tensor {name!r} has unknown base {tensor.base!r}")
        producer = ops[position[tensor.producer]]
        if tensor.base not in producer.inputs:
            raise SlackSwapError(
                f"graph: tensor {name!r} aliases {tensor.base!r}, which its producer {producer.name!r} does not read"
            )
    for name, tensor in tensors.items():
        if tensor.held_until:
            if tensor.held_until not in position:
                raise SlackSwapError(f"graph: tensor {name!r} is held until unknown op {tensor.held_until!r}")
            if position[tensor.held_until] < position[tensor.producer]:
                raise SlackSwapError(
                    f"graph: tensor {name!r} is held until op {tensor.held_until!r}, before its producer "
                    f"{tensor.producer!r}"
                )
    for op in ops:
        for t in op.writes:
            if t not in op.inputs:
                raise SlackSwapError(f"graph: op {op.name!r} writes {t!r} in place but does not read it")
            if not any(tensors[o].base == t for o in op.outputs):
                raise SlackSwapError(
                    f"graph: op {op.name!r} writes {t!r} in place but no output of it aliases {t!r} (base={t!r})"
                )
            late = [c for c in tensors[t].consumers if position[c] > position[op.name]]
            if late:
                raise SlackSwapError(
                    f"graph: op {late[0]!r} reads {t!r} after op {op.name!r} overwrote it in place; "
                    "it must read the new version"
                )
