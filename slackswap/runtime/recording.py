"""What the runtime records of a verified step: the graph tensors and inputs ATen calls read, the
recorded calls of each recomputed op, and the saved-tensor events (kept apart from `slackswap.runtime.eager`, which
uses them, to keep that module one concern)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slackswap.plan import Decision


@dataclass(frozen=True)
class TensorRef:
    """A graph tensor as some ATen call saw it: which tensor, and the view it used."""

    name: str
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    #: In-place writes into its storage before the call read it (`replay_check.WriteCounts`; -1: unchecked).
    version: int = -1


@dataclass(frozen=True)
class InputRef:
    """A model input (a forward argument, by flattened position) as a recorded ATen call saw it."""

    index: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Member:
    func: Any
    spec: Any
    rng: tuple[torch.Tensor, torch.Tensor | None] | None
    fresh: list[tuple[int, str]]
    #: Hook-only steps: the pack event after which the RNG is in the state this random call drew
    #: from (-1: the model's forward pre-hook); None when another random call came in between.
    rng_event: int | None = None


@dataclass(frozen=True)
class PackRecord:
    """The k-th tensor autograd saved in the verified step: what it is and where the plan was."""

    name: str | None
    shape: torch.Size
    dtype: torch.dtype
    decision: Decision | None
    #: Plan steps before this index had finished when the tensor was packed.
    position: int
    #: The view autograd saved (a hook-only step hands the recorded geometry back when it matches).
    stride: tuple[int, ...] = ()
    offset: int = 0


@dataclass(frozen=True)
class Recording:
    """What a verified step (dispatch modes on) tells the later hook-only steps.

    Autograd packs and unpacks saved tensors in the same order on every step of the same code path,
    so the k-th pack names the k-th recorded tensor (checked by shape and dtype) and the u-th unpack
    is at the recorded plan position. `refusal` says why hook-only steps cannot run this plan (every
    step then runs verified)."""

    packs: tuple[PackRecord, ...]
    #: Per unpack event, in order: the plan position reached, and the tensor name (None: kept or not
    #: a graph tensor).
    unpacks: tuple[tuple[int, str | None], ...]
    members: dict[str, list[_Member]]
    #: Pack events whose RNG state a recomputed random call needs (-1: the forward pre-hook).
    rng_events: frozenset[int]
    refusal: str | None = None
    #: The leaf modules the step called, in order (`eager.module_calls`): what a hook-only step is checked against.
    module_calls: tuple[int, ...] = ()
    #: The modules' Python number attributes and parameter and buffer objects as the step began
    #: (`eager.module_calls.ModuleState`).
    module_state: tuple = ()
    #: Per unpack event, the type of the autograd node that read it back (`torch._C._current_autograd_node`):
    #: what a recomputing plan's hook-only step checks at each tensor it hands back.
    unpack_nodes: tuple = ()
    #: Per model call, its arguments' Python values (`eager.module_calls.forward_arguments`): a recomputing
    #: plan's hook-only step whose call differs runs verified instead.
    forward_arguments: tuple = ()
    #: The bools the model's forward read from tensors, in order (`eager.value_reads`): a recomputing plan's
    #: hook-only step raises at the first that differs.
    value_reads: tuple = ()
    #: The module globals and closure cells holding plain values that the forward's Python functions read
    #: (`eager.global_reads`), and their values then: a recomputing plan's hook-only step whose slots hold
    #: other values runs verified instead. Slots None: not recorded (the next step runs verified).
    global_slots: tuple | None = ()
    global_values: tuple = ()
