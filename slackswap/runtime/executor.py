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

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from slackswap.errors import SlackSwapError
from slackswap.graph import Graph
from slackswap.plan import Decision, Plan, StepKind
from slackswap.profile.torch.identity import StorageIdentities
from slackswap.runtime.capture import input_signature, loss_boundary, model_signature
from slackswap.runtime.copy_engines import (
    Copy,
    CpuCopies,
    CudaCopies,
    bind_offload,
    bind_prefetch,
    byte_view,
    offload_sizes,
)
from slackswap.runtime.hook_program import OFFLOAD, PREFETCH, RECOMPUTE, RELEASE, HookProgram, build_hook_program
from slackswap.runtime.ledger import SavedBytesLedger
from slackswap.runtime.op_numbering import IDENTITY_SCHEME, OpNumbering
from slackswap.runtime.recording import InputRef, PackRecord, Recording, TensorRef, _Member
from slackswap.runtime.replay_check import WriteCounts, scratch_state
from slackswap.schedule.validate import resolve_schedule


class PlanMismatchError(SlackSwapError):
    """The plan's graph does not describe the step being run (model, shapes, torch build, plan edits)."""


class _NoLedger:
    """Hook-only steps measure no ledger (it needs a dispatch mode after every op)."""

    peak_bytes = 0
    peak_step = -1
    live_by_step: dict[int, frozenset[int]] = {}
    device_peak_bytes = 0
    device_peak_step = -1
    device_live_by_step: dict[int, frozenset[int]] = {}

    def track(self, storage: object, copy_id: int, saved: bool = True) -> None:
        return None

    def poll(self, step: int) -> None:
        return None


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
    #: True: the step ran under the dispatch modes (every call checked, ledger measured); False: a
    #: hook-only step (saved-tensor hooks only; no ledger: its figures are 0).
    verified: bool = True
    #: Why this plan's steps cannot run hook-only (None: they can, or have).
    fast_refusal: str | None = None


def plan_counts(plan: Plan) -> dict[str, int]:
    return {
        "recompute_steps": sum(1 for s in plan.steps if s.kind == StepKind.RECOMPUTE),
        "offloads": len(plan.offloads),
        "prefetches": len(plan.prefetches),
    }


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The form in which the runtime holds a copy: `t` itself when it is exactly its storage
    (contiguous from offset 0), else the whole storage flat in `t`'s dtype (one `as_strided`, so the
    views of it are one `as_strided` each too), or as bytes when `t`'s elements do not tile it. Copy
    engines move that form, and `_read` hands it back as is when autograd saved that very view."""
    storage = t.untyped_storage()
    nbytes, size = storage.nbytes(), t.element_size()
    if t.storage_offset() == 0 and t.numel() * size == nbytes and t.is_contiguous():
        return t
    if nbytes % size == 0:
        return t.as_strided((nbytes // size,), (1,), 0)
    return byte_view(storage)


def _read(held: torch.Tensor, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...],
          offset: int) -> torch.Tensor:
    """The view (dtype, size, stride, offset) of a copy held in its `_whole` form: the copy itself when
    it is that view (no ATen call: the common case), one `as_strided` when only the geometry differs,
    else a view of its storage."""
    if held.dtype == dtype:
        if offset == 0 and held.shape == size and held.stride() == stride:
            return held
        return held.as_strided(size, stride, offset)
    return torch.empty(0, dtype=dtype, device=held.device).set_(held.untyped_storage(), offset, size, stride)


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


class RuntimeUsageError(PlanMismatchError):
    """The runtime was used in a way it cannot run exactly (nesting, torch.compile): says what to do."""


_ACTIVE: list[PlanRun] = []


def _compiled(model: torch.nn.Module) -> str | None:
    """The path of a module that torch.compile wraps (`torch.compile(m)` or `m.compile()`), or None."""
    if type(model).__name__ == "OptimizedModule":
        return "<the model>"
    for name, m in model.named_modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            return name or "<the model>"
    return None


class PlanRun(TorchDispatchMode):
    """`with apply(plan, graph, model): ...` runs one training step under the plan. Reusable per step."""

    def __init__(
        self, plan: Plan, graph: Graph, model: torch.nn.Module, copies: object | None = None, trace: bool = False,
        accumulate: bool = False, verify: bool = False,
    ):
        super().__init__()
        compiled = _compiled(model)
        if compiled is not None:
            raise RuntimeUsageError(
                f"module {compiled!r} is torch.compile'd: under the eager runtime's dispatch modes torch.compile "
                "falls back to eager, silently. Run the plan through PyTorch instead: "
                "slackswap.runtime.export.PlanExport(plan, graph, model).installed(model, compile=True)"
            )
        self.trace = trace
        self.accumulate = accumulate
        #: Every step under the dispatch modes (else only the first, and after a refusal).
        self.verify = verify
        self.recording: Recording | None = None
        #: Built at the first hook-only step, from the recording (`hook_program`).
        self._program: HookProgram | None = None
        check_identity(graph, model)
        self.plan, self.graph, self.model = plan, graph, model
        #: The traced inputs as `_check_inputs` compares them each step: (shape, dtype) per tensor.
        self._traced_inputs = [(torch.Size(shape), getattr(torch, dtype.removeprefix("torch.")))
                               for shape, dtype in graph.meta.get("input_signature") or []]
        self.schedule = resolve_schedule(graph, plan)  # PlanValidationError names a bad plan
        self._never_read = frozenset(graph.meta.get("packed_never_read") or ())
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
        #: Built once: `ResolvedSchedule.copies` rebuilds every Copy on each access.
        self.copy_records = self.schedule.copies
        #: Per copy: its source, read on every swapped or recomputed unpack.
        self.copy_source = self.schedule.copy_source
        for c, copy in enumerate(self.copy_records):
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
        #: The plan keeps every tensor and moves none: a hook-only step has nothing to do.
        self.idle = not (recompute_steps or plan.offloads or plan.prefetches) and all(
            d == Decision.KEEP for d in plan.decisions.values())
        #: Steps at whose end the plan acts (a recompute, a transfer issued after it, a release).
        self._action_steps = sorted(
            recompute_steps | set(self.release_after)
            | {j for j in range(n) if self.offloads_at[j + 1] or self.prefetches_at[j + 1]})

    def _default_copies(self) -> object:
        """CUDA streams with one pinned slab sized from the plan's offloads on a GPU; inline CPU copies."""
        if any(p.is_cuda for p in self.model.parameters()):
            return CudaCopies(offload_sizes(self.schedule))
        return CpuCopies()

    # ----------------------------------------------------------------------------- step lifecycle
    def __enter__(self) -> PlanRun:
        if _ACTIVE:
            raise RuntimeUsageError(
                "apply(...) entered while another plan run is active"
                + (" (this same run)" if self in _ACTIVE else "")
                + ": a plan describes exactly one step, and a run inside a run would see the outer run's calls. "
                "Exit the outer `with` first; for micro-batches enter one run per micro-batch with "
                "apply(..., accumulate=True)"
            )
        self._stashed: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        if self.accumulate:
            # Micro-batches: an existing .grad would turn AccumulateGrad's assignment into an in-place
            # add the graph lacks. Set it aside and add it back after the step: the same float addition
            # AccumulateGrad does (old + new), so the sum is bit for bit a plain accumulation's.
            for p in self.model.parameters():
                if p.grad is not None:
                    self._stashed.append((p, p.grad))
                    p.grad = None
        _ACTIVE.append(self)
        try:
            self._enter()
        except BaseException:
            _ACTIVE.remove(self)
            for p, old in self._stashed:
                p.grad = old
            raise
        return self

    def _enter(self) -> None:
        self.fast = self.recording is not None and self.recording.refusal is None and not (self.trace or self.verify)
        if self.fast:
            self._enter_fast()
            return
        self._packs: list[PackRecord] = []
        self._unpacks: list[tuple[int, str | None]] = []
        self._random_since_pack = False
        self._refusal: str | None = None
        self._packed_names: set[str] = set()
        self._step_inputs: list[torch.Tensor] = []
        self.identities = StorageIdentities(self.model)
        self.numbering = OpNumbering(self.identities)
        self.ledger = SavedBytesLedger(self.trace)
        self.report = RunReport()
        self.pos = 0
        self.current: int | None = None
        self.current_copy: dict[str, int] = {}
        self.held: dict[int, Any] = {}
        #: Per offload issued: its host copy (a `Copy` in flight, or the tensor of an inline one).
        self.hosts: dict[int, Copy | torch.Tensor] = {}
        self.members: dict[str, list[_Member]] = {}
        #: Per offload: the device of its source (where its prefetches go), for the hook program.
        self._offload_devices: dict[int, torch.device] = {}
        self.internal = False
        self.versions = WriteCounts()
        if self.copies is None:
            self.copies = self._default_copies()
        self._input_hook = self.model.register_forward_pre_hook(self._check_inputs, with_kwargs=True)
        self._loss_boundary = loss_boundary(self.model, self.identities)
        self._loss_boundary.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self.identities.__enter__()
        super().__enter__()
        self._issue(0)

    def __exit__(self, exc_type, exc, tb) -> None:
        _ACTIVE.remove(self)
        try:
            if self.fast:
                self._exit_fast(exc_type)
            else:
                self._exit(exc_type, exc, tb)
                if exc_type is None and self.recording is None:
                    self.recording = self._finish_recording()
                    if self.recording.refusal is None:
                        self._program = self._build_program()
                        if self._program.refusal is not None:
                            self.recording = replace(self.recording, refusal=self._program.refusal)
                        else:
                            self._bind_program()
                self.report.fast_refusal = self.recording.refusal if self.recording is not None else None
        finally:
            for p, old in self._stashed:
                p.grad = old if p.grad is None else old.add_(p.grad)
            self._stashed = []

    def _exit(self, exc_type, exc, tb) -> None:
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
            self._last_members, self.members = self.members, {}
            self.ledger.poll(-1)
            self.report.ledger_peak_bytes = self.ledger.peak_bytes
            self.report.ledger_peak_step = self.ledger.peak_step
            self.report.device_peak_bytes = self.ledger.device_peak_bytes
            self.report.device_peak_step = self.ledger.device_peak_step
            self.report.live_by_step = self.ledger.live_by_step
            self.report.device_live_by_step = self.ledger.device_live_by_step
            self.report.aten_calls = self.numbering.calls

    def _check_inputs(self, _module, args, kwargs) -> None:
        if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call: no tree to walk
            inputs = list(args)
        else:
            inputs = [t for t in tree_leaves([args, kwargs]) if isinstance(t, torch.Tensor)]
        self._step_inputs = inputs
        if self.fast and -1 in self.recording.rng_events:
            self._fast_rng[-1] = _rng_state()
        if [(t.shape, t.dtype) for t in inputs] != self._traced_inputs:
            raise PlanMismatchError(
                f"model inputs (shape, dtype) {input_signature(inputs)} differ from the traced "
                f"{self.graph.meta.get('input_signature')} of graph {self.graph.name!r}"
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
                expected = next((s.op for s in self.plan.steps[self.pos:] if s.kind == StepKind.RUN), None)
                raise PlanMismatchError(
                    f"ATen call {begin.op!r} is not an op of graph {self.graph.name!r} (traced "
                    f"{self.graph.meta.get('aten_calls')} calls; the plan expected {expected!r} next): the code path "
                    "changed (the model, its inputs, its train/eval mode, a data-dependent branch), or gradients "
                    "were not None before the step. Capture and plan again for the new code path; clear "
                    "gradients (optimizer.zero_grad()) or use apply(..., accumulate=True) for micro-batches"
                )
            self._advance_to(j)
            self.current = j
        record = begin.op in self.recompute_ops
        random = torch.Tag.nondeterministic_seeded in func.tags
        if record:
            rng = rng_event = None
            if random:
                rng = _rng_state()
                rng_event = None if self._random_since_pack else len(self._packs) - 1
                if rng_event is None:
                    self._refuse(f"random call {begin.op!r} follows another random call with no saved tensor "
                                 "between them: its RNG state has no hook to be read at")
            member = _Member(func, tree_map(self._to_spec, (args, kwargs)), rng, [], rng_event)
            self.members.setdefault(begin.op, []).append(member)
        if random:
            self._random_since_pack = True
        self.versions.note(func, args, begin.op, begin.new_op, self.numbering.name_of)
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
                # An alias, not `t`: a reference to the op's output itself makes PyTorch alias it
                # (a detach call the graph lacks); made with every mode off, unseen by the identities.
                with _disable_current_modes():
                    self.held[c] = _whole(t.detach())
        self.ledger.poll(self.current)  # a joined write may belong to an earlier op (`OpNumbering`)
        return out

    def _to_spec(self, x: object) -> object:
        if isinstance(x, torch.Tensor):
            name = self.numbering.name_of(x)
            if name is not None:
                return TensorRef(name, x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset(),
                                 self.versions.total[name])
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
        """Issue the transfers the plan puts after step bucket-1. In a verified step with every mode
        off: issued from inside an op's dispatch, the copies' calls would otherwise reach the
        identities below it, which count every op of a module call (a copy engine's clone would
        shift the names of the model's own clones after it)."""
        if not (self.offloads_at[bucket] or self.prefetches_at[bucket]):
            return
        self.internal = True
        try:
            with _disable_current_modes():
                self._issue_transfers(bucket)
        finally:
            self.internal = False

    def _issue_transfers(self, bucket: int) -> None:
        for k in self.offloads_at[bucket]:
            c = self.schedule.offload_copy[k]
            source = self.held[c]
            self.hosts[k] = self.copies.offload(source, k)
            self.versions.offloaded[k] = self.versions.total[self.plan.offloads[k].tensor]
            self._offload_devices[k] = source.device
            self.report.offloads += 1
        for k in self.prefetches_at[bucket]:
            offload = self.schedule.prefetch_offload[k]
            arriving = self.copies.prefetch(self.hosts[offload], self._offload_devices[offload])
            c = self.schedule.prefetch_copy[k]
            tensor = self.plan.prefetches[k].tensor
            self.held[c] = arriving
            self.versions.copy[c] = self.versions.offloaded[offload]
            self.current_copy[tensor] = c
            self.ledger.track(arriving.storage if isinstance(arriving, Copy) else arriving.untyped_storage(), c)
            self.report.prefetches += 1

    def _copy_of(self, c: int) -> torch.Tensor:
        """Copy `c` as held (`_whole` form); a prefetch not yet arrived is waited for."""
        held = self.held.get(c)
        if isinstance(held, Copy):  # a transfer in flight (an inline copy is its tensor, arrived)
            if not held.arrived():
                self.report.late_prefetch_waits += 1
            held.wait()
            return held.tensor
        if held is None:
            copy = self.copy_records[c]
            raise PlanMismatchError(f"tensor {copy.tensor!r}: its {copy.source} copy is not held at this point")
        return held

    # ----------------------------------------------------------------------------- recompute
    def _recompute(self, j: int, reads: dict[str, int] | None = None) -> None:
        """Re-run plan step `j`'s recorded calls. `reads`: on a hook-only step, the copy each tensor it
        reads is (resolved with the program); else the current copies."""
        step = self.plan.steps[j]
        current_copy = self.current_copy if reads is None else reads
        members = self.members.get(step.op)
        if not members:
            raise PlanMismatchError(f"plan step {j} recomputes {step.op!r}, which did not run in this forward")
        env: dict[str, torch.Tensor] = {}

        def resolve(x: object) -> object:
            if isinstance(x, InputRef):
                return _read(_whole(self._step_inputs[x.index]), x.dtype, x.size, x.stride, x.offset)
            if not isinstance(x, TensorRef):
                return x
            held = env.get(x.name)
            if held is None:
                c = current_copy.get(x.name)
                if c is None:
                    raise PlanMismatchError(f"plan step {j} ({step.op!r}) reads {x.name!r}, which has no copy")
                if not self.fast and self.copy_source[c] == "run" and x.name not in self._packed_names:
                    self._refuse(f"plan step {j} ({step.op!r}) reads {x.name!r}, a tensor autograd does not save: "
                                 "no saved-tensor hook hands it over")
                if not self.fast:
                    self.versions.check(x.name, x.version, self._copy_version(c, x.name), f"plan step {j} "
                                        f"recomputes {step.op!r}, which reads")
                held = self._copy_of(c)
            return _read(held, x.dtype, x.size, x.stride, x.offset)

        self.internal = True
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                for m in members:
                    rng = m.rng if not self.fast or m.rng is None else self._fast_rng[m.rng_event]
                    if rng is not None:
                        torch.set_rng_state(rng[0])
                        if rng[1] is not None:
                            torch.cuda.set_rng_state(rng[1])
                    args, kwargs = tree_map(resolve, m.spec, is_leaf=lambda x: isinstance(x, (TensorRef, InputRef)))
                    args = scratch_state(m.func, m.spec[0], args, lambda x: isinstance(x, TensorRef))
                    leaves = tree_leaves(m.func(*args, **kwargs))
                    for index, name in m.fresh:
                        env[name] = _whole(leaves[index])
                    self.report.recompute_aten_calls += 1
        finally:
            self.internal = False
        for name, c in zip(step.outputs, self.schedule.step_writes[j], strict=True):
            self.held[c] = env[name]
            self.current_copy[name] = c
            if not self.fast:
                self.versions.copy[c] = self.versions.own[name]
            self.ledger.track(env[name].untyped_storage(), c, self.graph.tensors[name].saved)
        self.report.recompute_steps += 1
        self.ledger.poll(j)

    def _copy_version(self, c: int, name: str) -> int:
        """In-place writes copy `c` of `name` holds: a run copy is the storage (the live count)."""
        return self.versions.total[name] if self.copy_source[c] == "run" else self.versions.copy.get(c, -2)

    # ----------------------------------------------------------------------------- saved tensors
    def _pack(self, t: torch.Tensor) -> object:
        if self.internal:
            return t
        name = self.numbering.name_of(t)
        decision = None if name is None else self.plan.decisions.get(name)
        if decision is None and name in self._never_read:
            decision = Decision.KEEP  # packed, never unpacked (no gradient reaches its node): as captured
        position = self.pos if self.current is None else self.current + 1
        self._packs.append(PackRecord(name, t.shape, t.dtype, decision, position, tuple(t.stride()),
                                      t.storage_offset()))
        self._random_since_pack = False
        if name is None:
            return t  # a weight or an input: not an activation of the graph
        if decision is None:
            raise PlanMismatchError(
                f"autograd saves tensor {name!r}, which graph {self.graph.name!r} does not list as saved"
            )
        self._packed_names.add(name)
        if decision == Decision.KEEP:
            return t
        return TensorRef(name, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                         self.versions.total[name])

    def _unpack(self, packed: object) -> torch.Tensor:
        self.numbering.close_op()
        self._finish_current()
        self._advance_recomputes()
        self._unpacks.append((self.pos, packed.name if isinstance(packed, TensorRef) else None))
        if not isinstance(packed, TensorRef):
            return packed
        c = self.current_copy[packed.name]
        wanted = "prefetch" if self.plan.decisions[packed.name] == Decision.SWAP else "recompute"
        source = self.copy_source[c]
        if source != wanted:
            raise PlanMismatchError(
                f"autograd reads {packed.name!r} before plan step {self.pos} while its current copy is the "
                f"{source} copy, not a {wanted} copy: the plan places the {wanted} after the reader"
            )
        self.versions.check(packed.name, packed.version, self._copy_version(c, packed.name),
                            f"autograd unpacks the {source}")
        held = self._copy_of(c)
        self.internal = True
        try:
            return _read(held, packed.dtype, packed.size, packed.stride, packed.offset)
        finally:
            self.internal = False


    # ----------------------------------------------------------------------------- recording
    def _refuse(self, why: str) -> None:
        if self._refusal is None:
            self._refusal = why

    def _finish_recording(self) -> Recording:
        """After a complete verified step: what the hook-only steps need. Arguments of recomputed calls
        that are not graph tensors must be parameters or buffers (the same storage every step) or
        model inputs (taken from each step's forward pre-hook); anything else refuses."""
        owned = {t.untyped_storage().data_ptr() for t in [*self.model.parameters(), *self.model.buffers()]}
        inputs = {t.untyped_storage().data_ptr(): i for i, t in enumerate(self._step_inputs)}

        def external(x: object, op: str) -> object:
            if not isinstance(x, torch.Tensor):
                return x
            ptr = x.untyped_storage().data_ptr()
            if ptr in owned:
                return x
            if ptr in inputs:
                return InputRef(inputs[ptr], x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset())
            self._refuse(f"the recompute of {op!r} reads a tensor that is neither a graph tensor, a parameter "
                         "nor a model input")
            return x

        members = {
            op: [replace(m, spec=tree_map(lambda x, op=op: external(x, op), m.spec,
                                          is_leaf=lambda x: isinstance(x, TensorRef))) for m in ms]
            for op, ms in self._last_members.items()
        }
        events = frozenset(m.rng_event for ms in members.values() for m in ms if m.rng is not None
                           and m.rng_event is not None)
        return Recording(tuple(self._packs), tuple(self._unpacks), members, events, self._refusal)

    # ----------------------------------------------------------------------------- hook-only steps
    def _build_program(self) -> HookProgram:
        return build_hook_program(
            self.recording, self.plan, self.schedule, self.run_copy, self.held_copies, self.release_after,
            self.offloads_at, self.prefetches_at, self._action_steps, getattr(self.copies, "needs_poll", True),
            self._recompute_reads(), self._offload_devices)

    def _bind_program(self) -> None:
        """The program's events as the hooks read them, with this run's copy engine bound in: per pack
        its offloads as (offload, callable of the source) (`bind_offload`, for the copy's `form`), per
        unpack its prefetches as (offload, last, copy made, callable of the host copy), per offload the
        prefetch callable `_run_ops` uses, and per pack what an unpack of it reads back. Why: a swapped
        tensor's offload and prefetch are then one call each, with no engine method, buffer lookup or
        operation code in between (docs/runtime.md, "Hook-only steps")."""
        program, copies, devices = self._program, self.copies, self._offload_devices
        fetch = {k: bind_prefetch(copies, device) for k, device in devices.items()}
        self._fetch = fetch
        self._hot_packs = tuple(
            (p.dtype, p.shape, p.holds, p.held, tuple((j, bind_offload(copies, j, *p.form)) for j in p.offloads),
             p.ops, p.by_number, p.reads_rng, p.stride, p.offset, p.whole, p.form)
            for p in program.packs)
        self._hot_unpacks = tuple(
            (u.name, u.ops, u.copy, u.release, tuple((k, last, made, fetch[k]) for k, last, made in u.prefetches))
            for u in program.unpacks)
        self._reads = tuple((p.name, p.dtype, p.shape, p.stride, p.offset, p.whole) for p in program.packs)

    def _recompute_reads(self) -> dict[int, frozenset[str]]:
        """Per recompute step: the graph tensors its recorded calls read that they did not make."""
        reads = {}
        for j, step in enumerate(self.plan.steps):
            if step.kind != StepKind.RECOMPUTE:
                continue
            made: set[str] = set()
            read: set[str] = set()
            for m in self.recording.members.get(step.op, ()):
                read |= {x.name for x in tree_leaves(m.spec, is_leaf=lambda x: isinstance(x, TensorRef))
                         if isinstance(x, TensorRef) and x.name not in made}
                made |= {name for _, name in m.fresh}
            reads[j] = frozenset(read)
        return reads

    def _enter_fast(self) -> None:
        """A step on the saved-tensor hooks alone: no dispatch mode, cost per saved tensor."""
        self.report = RunReport(verified=False)
        self.ledger = _NoLedger()
        self.current = None
        self.current_copy = {}
        self.held = {}
        self.hosts = {}
        self.members = self.recording.members
        self.internal = False
        self._fast_rng: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._step_inputs = []
        self._input_hook = self.model.register_forward_pre_hook(self._check_inputs, with_kwargs=True)
        self._hooks = contextlib.nullcontext()
        self._reached = _nothing_reached
        if not self.idle:  # a plan that keeps everything and moves nothing needs no hook at all
            pack, unpack, self._reached = self._step_hooks()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()

    def _exit_fast(self, exc_type) -> None:
        self._hooks.__exit__(None, None, None)
        self._input_hook.remove()
        packs_reached, unpacks_reached = self._reached()
        try:
            if exc_type is None:
                packs, unpacks = len(self._program.packs), len(self._program.unpacks)
                if not self.idle and (packs_reached, unpacks_reached) != (packs, unpacks):
                    raise PlanMismatchError(
                        f"this step saved {packs_reached} and read back {unpacks_reached} tensors; the verified step "
                        f"saved {packs} and read back {unpacks}: the code path changed (or backward did not run "
                        "inside the context). Capture and plan again for the new code path"
                    )
                self._run_ops(self._program.tail)
        finally:
            offloads, prefetches = self._program.transfers(packs_reached, unpacks_reached, exc_type is None)
            self.report.offloads += offloads
            self.report.prefetches += prefetches
            self.copies.close()
            self.held.clear()
            self.hosts.clear()
            self._fast_rng.clear()
            self._step_inputs = []

    def _run_ops(self, ops: tuple[tuple, ...]) -> None:
        """Run the plan's operations due at an event (`hook_program`: releases, transfer issues,
        recompute steps), in the order the plan puts them; tested most frequent first. The step's
        transfers are counted from the program when it exits (`HookProgram.transfers`)."""
        held, hosts, copies = self.held, self.hosts, self.copies
        for op in ops:
            kind = op[0]
            if kind == RELEASE:
                held.pop(op[1], None)
            elif kind == OFFLOAD:
                hosts[op[1]] = copies.offload(held[op[2]], op[1])
            elif kind == PREFETCH:
                _, offload, last, c, _, _ = op
                held[c] = self._fetch[offload](hosts.pop(offload) if last else hosts[offload])
            elif kind == RECOMPUTE:
                self._recompute(op[1], op[2])
            else:
                copies.poll()

    def _step_hooks(self) -> tuple[Callable, Callable, Callable[[], tuple[int, int]]]:
        """This step's saved-tensor hooks, and a callable telling how many packs and unpacks they have
        reached. Closures over the bound program (`_bind_program`) and the step's dicts, so that a hook
        reads its tables as local names: in CPython a closure cell costs a fraction of an attribute
        lookup on `self`, and a hook does a dozen of those (docs/runtime.md, "Hook-only steps")."""
        hot_packs, hot_unpacks, reads = self._hot_packs, self._hot_unpacks, self._reads
        held_copies, hosts, rng_states = self.held, self.hosts, self._fast_rng
        copies, run_ops, copy_of, pack_mismatch = self.copies, self._run_ops, self._copy_of, self._pack_mismatch
        tensor_type = torch.Tensor
        packs_reached = unpacks_reached = 0

        def pack(t: torch.Tensor) -> object:
            nonlocal packs_reached
            k = packs_reached
            try:
                dtype, shape, holds, held, offloads, ops, by_number, reads_rng, stride, offset, whole, form = \
                    hot_packs[k]
            except IndexError:
                raise pack_mismatch(k, t) from None
            if t.dtype is not dtype or t.shape != shape:
                raise pack_mismatch(k, t)  # not reached: its operations have not run
            packs_reached = k + 1
            if reads_rng:
                rng_states[k] = _rng_state()
            if holds < 0:  # nothing handed over (kept, not a graph tensor, or a later view of a copy)
                if ops:
                    run_ops(ops)
                if not by_number:
                    return t
                recorded = t.stride() == stride and t.storage_offset() == offset
            else:  # the tensor's first pack: its run copy, which the plan reads, is now at hand
                recorded = t.stride() == stride and t.storage_offset() == offset
                copy = t if recorded and whole else _whole(t)
                if held:
                    held_copies[holds] = copy
                if offloads:
                    if copy is t or (copy.dtype is form[0] and copy.shape == form[1]):
                        for j, offload in offloads:  # bound for the copy's form (`_bind_program`)
                            hosts[j] = offload(copy)
                    else:  # another geometry than the verified step's: the engine sizes its buffer
                        for j, _ in offloads:
                            hosts[j] = copies.offload(copy, j)
                if ops:
                    run_ops(ops)
                if not by_number:
                    return t
            if recorded:
                return k  # the recorded view: the unpack reads its geometry from the program
            return TensorRef(reads[k][0], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

        def unpack(packed: object) -> torch.Tensor:
            nonlocal unpacks_reached
            u = unpacks_reached
            try:
                wanted, ops, c, release, prefetches = hot_unpacks[u]
            except IndexError:  # not reached: the step's transfers are counted by the events reached
                raise PlanMismatchError(
                    f"backward reads back saved tensor {u + 1}; the verified step read back {len(hot_unpacks)}: "
                    "the code path changed. Capture and plan again") from None
            unpacks_reached = u + 1
            if prefetches:
                for offload, last, made, fetch in prefetches:
                    held_copies[made] = fetch(hosts.pop(offload) if last else hosts[offload])
            elif ops:
                run_ops(ops)
            if type(packed) is int:
                name, dtype, size, stride, offset, whole = reads[packed]
            elif type(packed) is TensorRef:
                name, dtype, size, stride, offset = packed.name, packed.dtype, packed.size, packed.stride, packed.offset
                whole = False
            else:
                return packed
            if name != wanted:
                raise PlanMismatchError(f"backward read {name!r} where the verified step read {wanted!r}: "
                                        "backward ran in another order (the code path changed)")
            held = held_copies.get(c)
            if type(held) is not tensor_type:  # in flight (a `Copy`), or not held: `_copy_of` says which
                held = copy_of(c)
            if release:  # its last reader: autograd holds it from here for as long as backward reads it
                del held_copies[c]
            # A copy is held contiguous from offset 0 (`_whole`), so when the saved view is too (`whole`)
            # the same dtype and shape make it that view: the common case, with no stride to compare.
            if whole and held.dtype is dtype and held.shape == size:
                return held
            return _read(held, dtype, size, stride, offset)

        def reached() -> tuple[int, int]:
            return packs_reached, unpacks_reached

        return pack, unpack, reached

    def _pack_mismatch(self, k: int, t: torch.Tensor) -> PlanMismatchError:
        """The error for pack `k` of a hook-only step, which autograd saved as `t`."""
        packs = self.recording.packs
        wanted = f"{packs[k].name!r} {tuple(packs[k].shape)} {packs[k].dtype}" if k < len(packs) else "nothing"
        return PlanMismatchError(
            f"autograd saves a {tuple(t.shape)} {t.dtype} tensor as saved tensor {k} of the step; the verified "
            f"step saved {wanted} there: the code path changed (model, inputs, train/eval mode, a "
            "data-dependent branch). Capture and plan again for the new code path"
        )


def _nothing_reached() -> tuple[int, int]:
    return 0, 0


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def apply(
    plan: Plan, graph: Graph, model: torch.nn.Module, copies: object | None = None, trace: bool = False,
    accumulate: bool = False, verify: bool = False,
) -> PlanRun:
    """Context manager running one training step of `model` under `plan` (checked against `graph` now).

    `copies`: a copy engine (default: CUDA streams when the model is on a GPU, inline CPU copies
    otherwise). `trace`: keep the per-step live copies in the report, for `explain_ledger`.
    `accumulate`: gradients already present are added to (micro-batches), bit for bit as plain
    PyTorch accumulates them. The first step runs verified (dispatch modes: every ATen call checked
    against the graph, the ledger measured) and records the pack order; later steps run on the
    saved-tensor hooks alone (docs/runtime.md, "Hook-only steps"). `verify` or `trace`: every step
    verified.
    """
    return PlanRun(plan, graph, model, copies, trace, accumulate, verify)
