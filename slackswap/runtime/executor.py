"""Execute a `Plan` in a real PyTorch training step: keep, swap or recompute each saved tensor.

How one step runs (docs/runtime.md has the why of each choice):
- A `TorchDispatchMode` sees every ATen call. `OpNumbering` names it, which places it on the plan:
  the call of graph op X is plan step `run_step[X]`. Before it runs, every recompute step and
  transfer the plan puts earlier is executed or issued; the call's fresh outputs become the run
  copies of their tensors.
- `saved_tensors_hooks` decide per saved tensor: keep returns the tensor (autograd saves it as
  usual); swap and recompute return a small reference, so autograd holds no device memory for them.
- Offloads and prefetches are issued at the plan's positions on the copy engines (`copies.py`). An
  unpack of a swapped tensor waits for its prefetch only if it has not arrived.
- Recompute steps replay the recorded ATen calls of the op (in-place members included) on the copies
  resident at that point, with the RNG state of the forward call restored, so dropout masks match.
- Held copies are released once the plan says their last reader has run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from slackswap.errors import SlackSwapError
from slackswap.graph import Graph
from slackswap.plan import Decision, Plan, StepKind
from slackswap.profile.torch.identity import StorageIdentities
from slackswap.runtime.capture import input_signature, loss_boundary, model_signature
from slackswap.runtime.copies import Copy, CpuCopies, CudaCopies
from slackswap.runtime.identity import IDENTITY_SCHEME, OpNumbering
from slackswap.runtime.ledger import SavedBytesLedger
from slackswap.schedule.validate import resolve_schedule


class PlanMismatchError(SlackSwapError):
    """The plan's graph does not describe the step being run (model, shapes, torch build, plan edits)."""


@dataclass(frozen=True)
class TensorRef:
    """A graph tensor as some ATen call saw it: which tensor, and the view it used."""

    name: str
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


@dataclass
class RunReport:
    """What one step under the runtime did; `equals_plan` compares the counts with the plan's."""

    ledger_peak_bytes: int = 0
    #: Plan step during which the ledger peaked (-1: outside any step).
    ledger_peak_step: int = -1
    #: Peak of every device storage of a graph tensor (not only saved ones): the simulator's
    #: `peak_activation_bytes` on the same link; and the plan step where it was reached.
    device_peak_bytes: int = 0
    device_peak_step: int = -1
    #: Per plan step, the copies of every graph tensor alive in it; when traced.
    device_live_by_step: dict[int, frozenset[int]] = field(default_factory=dict)
    #: Per plan step, the copies (ids into the plan's resolved schedule) alive in it; when traced.
    live_by_step: dict[int, frozenset[int]] = field(default_factory=dict)
    aten_calls: int = 0
    recompute_steps: int = 0
    recompute_aten_calls: int = 0
    offloads: int = 0
    prefetches: int = 0
    #: Unpacks that found their prefetch not yet arrived and made compute wait for it.
    late_prefetch_waits: int = 0
    counts_by_kind: dict[str, int] = field(default_factory=dict)


def plan_counts(plan: Plan) -> dict[str, int]:
    return {
        "recompute_steps": sum(1 for s in plan.steps if s.kind == StepKind.RECOMPUTE),
        "offloads": len(plan.offloads),
        "prefetches": len(plan.prefetches),
    }


def _view(storage: torch.UntypedStorage, ref: TensorRef) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(storage, ref.offset, ref.size, ref.stride)


def check_identity(graph: Graph, model: torch.nn.Module) -> None:
    """Before training: the graph must come from this model, this torch build and our naming scheme."""
    meta = graph.meta
    wanted = {
        "identity_scheme": IDENTITY_SCHEME,
        "torch_version": torch.__version__,
        "model_signature": model_signature(model),
    }
    for key, value in wanted.items():
        if meta.get(key) != value:
            raise PlanMismatchError(
                f"graph {graph.name!r}: meta[{key!r}]={meta.get(key)!r} but this run has {value!r}; "
                "capture the graph from this model with this torch build (slackswap.runtime.capture_graph) "
                "and plan again, or move a plan of the meta-traced graph onto it (runtime.translate)"
            )


class PlanRun(TorchDispatchMode):
    """`with apply(plan, graph, model): ...` runs one training step under the plan. Reusable per step."""

    def __init__(
        self, plan: Plan, graph: Graph, model: torch.nn.Module, copies: object | None = None, trace: bool = False
    ):
        super().__init__()
        self.trace = trace
        check_identity(graph, model)
        self.plan, self.graph, self.model = plan, graph, model
        self.schedule = resolve_schedule(graph, plan)  # PlanValidationError names a bad plan
        self.copies = copies
        steps = plan.steps
        self.run_step = {s.op: j for j, s in enumerate(steps) if s.kind == StepKind.RUN}
        self.recompute_ops = {s.op for s in steps if s.kind == StepKind.RECOMPUTE}
        n = len(steps)
        self.offloads_at: list[list[int]] = [[] for _ in range(n + 1)]
        self.prefetches_at: list[list[int]] = [[] for _ in range(n + 1)]
        for k, tr in enumerate(plan.offloads):
            self.offloads_at[tr.issue_after_step + 1].append(k)
        for k, tr in enumerate(plan.prefetches):
            self.prefetches_at[tr.issue_after_step + 1].append(k)
        self.run_copy: dict[str, int] = {}
        self.held_copies: set[int] = set()
        self.release_after: dict[int, list[int]] = {}
        recompute_steps = {j for j, s in enumerate(steps) if s.kind == StepKind.RECOMPUTE}
        for c, copy in enumerate(self.schedule.copies):
            if copy.source == "run":
                self.run_copy[copy.tensor] = c
            needs_hold = copy.source != "run" or copy.offload is not None or bool(set(copy.readers) & recompute_steps)
            if not needs_hold:
                continue
            self.held_copies.add(c)
            produced = copy.source_index
            if copy.source == "prefetch":
                produced = plan.prefetches[copy.source_index].issue_after_step
            # The resolver's facts: its last use (readers, views, the model's hold) and the offloads
            # it waits for (issued by then on this runtime's copy engines, which it then holds).
            last = max([produced, copy.last_use, *(plan.offloads[k].issue_after_step for k in copy.wait_offloads)])
            self.release_after.setdefault(last, []).append(c)

    # ----------------------------------------------------------------------------- step lifecycle
    def __enter__(self) -> PlanRun:
        self.identities = StorageIdentities(self.model)
        self.numbering = OpNumbering(self.identities)
        self.ledger = SavedBytesLedger(self.trace)
        self.report = RunReport()
        self.pos = 0
        self.current: int | None = None
        self.current_copy: dict[str, int] = {}
        self.held: dict[int, Any] = {}
        self.hosts: dict[int, tuple[Copy, torch.device]] = {}
        self.members: dict[str, list[_Member]] = {}
        self.internal = False
        if self.copies is None:
            on_cuda = any(p.is_cuda for p in self.model.parameters())
            self.copies = CudaCopies() if on_cuda else CpuCopies()
        self._input_hook = self.model.register_forward_pre_hook(self._check_inputs, with_kwargs=True)
        self._loss_boundary = loss_boundary(self.model, self.identities)
        self._loss_boundary.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self.identities.__enter__()
        super().__enter__()
        self._issue(0)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        super().__exit__(exc_type, exc, tb)
        self.identities.__exit__(exc_type, exc, tb)
        self._hooks.__exit__(exc_type, exc, tb)
        self._loss_boundary.__exit__(exc_type, exc, tb)
        self._input_hook.remove()
        try:
            if exc_type is None:
                self._finish_current()
                self._advance_recomputes()
                if self.pos != len(self.plan.steps):
                    step = self.plan.steps[self.pos]
                    raise PlanMismatchError(
                        f"the step ended before plan step {self.pos} ({step.kind!s} {step.op!r}) of "
                        f"{len(self.plan.steps)}: run forward and loss.backward() inside the context, "
                        "with the gradients set to None before it (optimizer.zero_grad())"
                    )
        finally:
            self.copies.close()
            self.held.clear()
            self.hosts.clear()
            self.members.clear()
            self.ledger.poll(-1)
            self.report.ledger_peak_bytes = self.ledger.peak_bytes
            self.report.ledger_peak_step = self.ledger.peak_step
            self.report.device_peak_bytes = self.ledger.device_peak_bytes
            self.report.device_peak_step = self.ledger.device_peak_step
            self.report.live_by_step = self.ledger.live_by_step
            self.report.device_live_by_step = self.ledger.device_live_by_step
            self.report.aten_calls = self.numbering.calls

    def _check_inputs(self, _module, args, kwargs) -> None:
        seen = input_signature([args, kwargs])
        traced = self.graph.meta.get("input_signature")
        if seen != traced:
            raise PlanMismatchError(
                f"model inputs (shape, dtype) {seen} differ from the traced {traced} of graph {self.graph.name!r}"
            )

    # ----------------------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.internal:  # the runtime's own copies, views and replays: invisible to the identities
            with _disable_current_modes():
                return func(*args, **kwargs)
        begin = self.numbering.begin(func, args, kwargs)
        if begin.new_op:
            self._finish_current()
            j = self.run_step.get(begin.op)
            if j is None:
                raise PlanMismatchError(
                    f"ATen call {begin.op!r} is not an op of graph {self.graph.name!r} (traced "
                    f"{self.graph.meta.get('aten_calls')} calls): the model, its inputs, its train/eval mode differ, "
                    "or gradients were not set to None before the step (optimizer.zero_grad())"
                )
            self._advance_to(j)
            self.current = j
        record = begin.op in self.recompute_ops
        if record:
            rng = None
            if torch.Tag.nondeterministic_seeded in func.tags:
                cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
                rng = (torch.get_rng_state(), cuda)
            member = _Member(func, tree_map(self._to_spec, (args, kwargs)), rng, [])
            self.members.setdefault(begin.op, []).append(member)
        out = func(*args, **kwargs)
        op = self.graph.op_by_name[begin.op]
        for index, name, t in self.numbering.end(func, out):
            nbytes = t.untyped_storage().nbytes()
            if name not in op.outputs or self.graph.tensors[name].size_bytes != nbytes:
                raise PlanMismatchError(
                    f"ATen call {begin.op!r} made tensor {name!r} of {nbytes} bytes; graph "
                    f"{self.graph.name!r} has {self.graph.tensors.get(name)}: shapes or dtypes differ"
                )
            if record:
                member.fresh.append((index, name))
            c = self.run_copy[name]
            self.current_copy[name] = c
            self.ledger.track(t.untyped_storage(), c, self.graph.tensors[name].saved)
            if c in self.held_copies:
                self.held[c] = t.untyped_storage()
        self.ledger.poll(self.run_step[begin.op])
        return out

    def _to_spec(self, x: object) -> object:
        if isinstance(x, torch.Tensor):
            name = self.numbering.name_of(x)
            if name is not None:
                return TensorRef(name, x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset())
        return x

    # ----------------------------------------------------------------------------- plan positions
    def _finish_current(self) -> None:
        if self.current is not None:
            j, self.current = self.current, None
            self._finish_step(j)

    def _finish_step(self, j: int) -> None:
        self._issue(j + 1)
        for c in self.release_after.get(j, ()):
            self.held.pop(c, None)
        self.pos = j + 1
        self.copies.poll()

    def _advance_to(self, j: int) -> None:
        while self.pos < j:
            step = self.plan.steps[self.pos]
            if step.kind == StepKind.RUN:
                raise PlanMismatchError(
                    f"op {self.plan.steps[j].op!r} (plan step {j}) ran before op {step.op!r} (plan step "
                    f"{self.pos}): PyTorch runs ops in the traced order, the plan orders them differently"
                )
            self._recompute(self.pos)
            self._finish_step(self.pos)
        if self.pos != j:
            raise PlanMismatchError(f"op {self.plan.steps[j].op!r} (plan step {j}) ran twice in one step")

    def _advance_recomputes(self) -> None:
        steps = self.plan.steps
        while self.pos < len(steps) and steps[self.pos].kind == StepKind.RECOMPUTE:
            self._recompute(self.pos)
            self._finish_step(self.pos)

    def _issue(self, bucket: int) -> None:
        """Issue the transfers the plan puts after step bucket-1."""
        self.internal = True
        try:
            for k in self.offloads_at[bucket]:
                c = self.schedule.offload_copy[k]
                source = self.held[c]
                self.hosts[k] = (self.copies.offload(source), source.device)
                self.report.offloads += 1
            for k in self.prefetches_at[bucket]:
                host, device = self.hosts[self.schedule.prefetch_offload[k]]
                arriving = self.copies.prefetch(host, device)
                c = self.schedule.prefetch_copy[k]
                tensor = self.plan.prefetches[k].tensor
                self.held[c] = arriving
                self.current_copy[tensor] = c
                self.ledger.track(arriving.storage, c)
                self.report.prefetches += 1
        finally:
            self.internal = False

    def _storage_of(self, c: int) -> torch.UntypedStorage:
        held = self.held.get(c)
        if held is None:
            copy = self.schedule.copies[c]
            raise PlanMismatchError(f"tensor {copy.tensor!r}: its {copy.source} copy is not held at this point")
        if isinstance(held, Copy):
            if not held.arrived():
                self.report.late_prefetch_waits += 1
            held.wait()
            return held.storage
        return held

    # ----------------------------------------------------------------------------- recompute
    def _recompute(self, j: int) -> None:
        step = self.plan.steps[j]
        members = self.members.get(step.op)
        if not members:
            raise PlanMismatchError(f"plan step {j} recomputes {step.op!r}, which did not run in this forward")
        env: dict[str, torch.UntypedStorage] = {}

        def resolve(x: object) -> object:
            if not isinstance(x, TensorRef):
                return x
            storage = env.get(x.name)
            if storage is None:
                c = self.current_copy.get(x.name)
                if c is None:
                    raise PlanMismatchError(f"plan step {j} ({step.op!r}) reads {x.name!r}, which has no copy")
                storage = self._storage_of(c)
            return _view(storage, x)

        self.internal = True
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                for m in members:
                    if m.rng is not None:
                        torch.set_rng_state(m.rng[0])
                        if m.rng[1] is not None:
                            torch.cuda.set_rng_state(m.rng[1])
                    args, kwargs = tree_map(resolve, m.spec, is_leaf=lambda x: isinstance(x, TensorRef))
                    leaves = tree_leaves(m.func(*args, **kwargs))
                    for index, name in m.fresh:
                        env[name] = leaves[index].untyped_storage()
                    self.report.recompute_aten_calls += 1
        finally:
            self.internal = False
        for name, c in zip(step.outputs, self.schedule.step_writes[j], strict=True):
            self.held[c] = env[name]
            self.current_copy[name] = c
            self.ledger.track(env[name], c, self.graph.tensors[name].saved)
        self.report.recompute_steps += 1
        self.ledger.poll(j)

    # ----------------------------------------------------------------------------- saved tensors
    def _pack(self, t: torch.Tensor) -> object:
        if self.internal:
            return t
        name = self.numbering.name_of(t)
        if name is None:
            return t  # a weight or an input: not an activation of the graph
        decision = self.plan.decisions.get(name)
        if decision is None:
            raise PlanMismatchError(
                f"autograd saves tensor {name!r}, which graph {self.graph.name!r} does not list as saved"
            )
        if decision == Decision.KEEP:
            return t
        return TensorRef(name, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _unpack(self, packed: object) -> torch.Tensor:
        self.numbering.close_op()
        self._finish_current()
        self._advance_recomputes()
        if not isinstance(packed, TensorRef):
            return packed
        c = self.current_copy[packed.name]
        wanted = "prefetch" if self.plan.decisions[packed.name] == Decision.SWAP else "recompute"
        copy = self.schedule.copies[c]
        if copy.source != wanted:
            raise PlanMismatchError(
                f"autograd reads {packed.name!r} before plan step {self.pos} while its current copy is the "
                f"{copy.source} copy, not a {wanted} copy: the plan places the {wanted} after the reader"
            )
        storage = self._storage_of(c)
        self.internal = True
        try:
            return _view(storage, packed)
        finally:
            self.internal = False


def apply(
    plan: Plan, graph: Graph, model: torch.nn.Module, copies: object | None = None, trace: bool = False
) -> PlanRun:
    """Context manager running one training step of `model` under `plan` (checked against `graph` now).

    `copies`: a copy engine (default: CUDA streams when the model is on a GPU, inline CPU copies
    otherwise). `trace`: keep the per-step live copies in the report, for `explain_ledger`.
    """
    return PlanRun(plan, graph, model, copies, trace)
