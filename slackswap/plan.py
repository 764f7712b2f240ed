"""A plan is a complete, explicit schedule. The simulator executes it and never chooses.

- `steps`: the compute stream, in order. A `run` step executes a graph op; a `recompute` step
  re-executes a forward op during backward and materialises only the listed `outputs`.
- `offloads` / `prefetches`: device->host and host->device copies. Each engine serves its list in
  the order given (FIFO). A transfer is issued when compute step `issue_after_step` finishes
  (-1: at time zero). A prefetch also waits for the tensor's offload to complete (the host copy must
  exist) and allocates its device memory when it starts.
- `decisions`: exactly one of keep / swap / recompute for every saved tensor of the graph, and keep or
  swap for any checkpoint candidate the plan keeps as an extra checkpoint (`Graph.candidate_tensors`:
  a forward tensor autograd does not save; undecided candidates are freed after forward as before).

Which copy of a tensor a step reads is decided by sequence position: the latest production of that
tensor (its run step, a recompute step, or a prefetch issued after an earlier step) before the step.

`graph_fingerprint` names the graph the plan was made for (`Graph.fingerprint`); the validator
refuses the plan on any other graph (`GraphMismatchError`). "" leaves it unchecked: hand-written
plans in tests, and plan.json files of schema version 1, which did not record it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

#: 2 added `graph_fingerprint`; plan_io still reads version 1.
PLAN_SCHEMA_VERSION = 2


class Decision(StrEnum):
    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


class StepKind(StrEnum):
    RUN = "run"
    RECOMPUTE = "recompute"


class Direction(StrEnum):
    D2H = "d2h"
    H2D = "h2d"


@dataclass(frozen=True)
class ComputeStep:
    op: str
    kind: StepKind
    #: Tensors this step materialises. A run step materialises all of its op's outputs.
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Transfer:
    tensor: str
    direction: Direction
    #: Index into `Plan.steps` whose completion issues this transfer; -1 issues it at time zero.
    issue_after_step: int


@dataclass(frozen=True)
class Plan:
    planner: str
    budget_bytes: int | None
    decisions: Mapping[str, Decision]
    steps: tuple[ComputeStep, ...]
    offloads: tuple[Transfer, ...] = ()
    prefetches: tuple[Transfer, ...] = ()
    #: A lower bound on step time under the simulator's semantics, where the planner knows one.
    bound_step_s: float | None = None
    #: Planner diagnostics (slack seconds, solver status, ...). Plain JSON-able values only.
    notes: Mapping[str, object] = field(default_factory=dict)
    #: `Graph.fingerprint` of the graph the plan was made for; "" when unknown (module docstring).
    graph_fingerprint: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "decisions", MappingProxyType(dict(self.decisions)))
        object.__setattr__(self, "notes", MappingProxyType(dict(self.notes)))

    def tensors_with(self, decision: Decision) -> tuple[str, ...]:
        return tuple(t for t, d in self.decisions.items() if d == decision)

    @property
    def idle(self) -> bool:
        """The plan keeps every tensor and moves none: no step of it needs a hook (the runtime runs it
        as a plain step; a prediction charges it none of the hooks' costs)."""
        return (not (self.offloads or self.prefetches) and all(s.kind != StepKind.RECOMPUTE for s in self.steps)
                and all(d == Decision.KEEP for d in self.decisions.values()))

    def schedule_key(self) -> tuple:
        """What of the plan the runtime executor reads (decisions, steps, transfers, graph): two plans
        equal in it run the same step, whichever planner made them and whatever notes they carry, so a
        check that has run one need not run the other."""
        return (tuple(sorted((n, d.value) for n, d in self.decisions.items())), self.steps, self.offloads,
                self.prefetches, self.graph_fingerprint)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (
            self.planner == other.planner
            and self.budget_bytes == other.budget_bytes
            and dict(self.decisions) == dict(other.decisions)
            and self.steps == other.steps
            and self.offloads == other.offloads
            and self.prefetches == other.prefetches
            and self.bound_step_s == other.bound_step_s
            and dict(self.notes) == dict(other.notes)
            and self.graph_fingerprint == other.graph_fingerprint
        )

    __hash__ = None  # type: ignore[assignment]
