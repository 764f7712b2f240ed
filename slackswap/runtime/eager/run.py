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

from dataclasses import replace

import torch
from torch.utils._pytree import tree_leaves

from slackswap.graph import Graph
from slackswap.plan import Plan, StepKind
from slackswap.runtime.capture import input_signature
from slackswap.runtime.copy_engines import (
    CpuCopies,
    CudaCopies,
    offload_sizes,
)
from slackswap.runtime.eager.global_reads import GlobalReads, first_change
from slackswap.runtime.eager.hook_only import _HookOnlyStep
from slackswap.runtime.eager.module_calls import ModuleCalls, ModuleState, forward_arguments, opaque_argument
from slackswap.runtime.eager.program import HookProgram
from slackswap.runtime.eager.value_reads import ValueReads
from slackswap.runtime.eager.verified import _VerifiedStep
from slackswap.runtime.eager.views import _rng_state
from slackswap.runtime.errors import PlanMismatchError, RuntimeUsageError
from slackswap.runtime.host_draws import draw_states, drawn_from, own_generators
from slackswap.runtime.identity import check_identity
from slackswap.runtime.recording import Recording
from slackswap.schedule.positions import plan_positions
from slackswap.schedule.validate import resolve_schedule

_ACTIVE: list[PlanRun] = []


def _compiled(model: torch.nn.Module) -> str | None:
    """The path of a module that torch.compile wraps (`torch.compile(m)` or `m.compile()`), or None."""
    if type(model).__name__ == "OptimizedModule":
        return "<the model>"
    for name, m in model.named_modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            return name or "<the model>"
    return None


class PlanRun(_HookOnlyStep, _VerifiedStep):
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
        #: Why the run set `verify` itself (a hook-only step found the path depends on the data), or None.
        self._verify_why: str | None = None
        self.recording: Recording | None = None
        #: Built as the verified step exits, from its recording (`eager.program`).
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
        #: Where the plan acts, built once (`schedule.positions`): the transfers after each step, the
        #: copies held and when each goes, each host copy's last prefetch.
        self.positions = positions = plan_positions(plan, self.schedule)
        self.offloads_at, self.prefetches_at = positions.offloads_at, positions.prefetches_at
        self.run_copy = positions.run_copy
        self.held_copies = positions.held_copies
        self.release_after = positions.release_after
        #: Built once: `ResolvedSchedule.copies` rebuilds every Copy on each access.
        self.copy_records = self.schedule.copies
        #: Per copy: its source, read on every swapped or recomputed unpack.
        self.copy_source = self.schedule.copy_source
        #: The plan keeps every tensor and moves none: a hook-only step has nothing to do.
        self.idle = plan.idle
        #: The model's leaf modules, whose calls a hook-only step of a recomputing plan checks (`ModuleCalls`).
        self.module_calls = ModuleCalls(model)
        self.module_state = ModuleState(model)
        #: A plan that recomputes checks its hook-only steps' module calls and numbers (`module_calls`);
        #: `slackswap.runtime.eager.host_cost` turns it off on one run to time the checks.
        self.checks_modules = any(s.kind == StepKind.RECOMPUTE for s in steps)

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
        #: A recomputing plan's step whose modules hold other Python numbers, parameters or buffers than the
        #: recorded step's runs verified (`ModuleState`), and its recording replaces the old one.
        self._module_state = self.module_state.snapshot() if self.checks_modules else ()
        because = self._verified_because()
        self.hook_only = because is None
        if self.hook_only:
            self._enter_hook_only()
            return
        self._enter_verified()
        self.report.verified_because = because

    def _verified_because(self) -> str | None:
        """Why this step runs verified, in a line (`RunReport.verified_because`); None: it may run on hooks
        alone (a recording to replay, and nothing it depends on changed)."""
        recording = self.recording
        if recording is None:
            return "the first step of a run records what the hook-only steps replay"
        if self.trace or self.verify:
            return self._verify_why or ("trace=True" if self.trace else "verify=True")
        if recording.refusal is not None:
            return f"hook-only steps are refused: {recording.refusal}"
        if self._module_state != recording.module_state:
            return ("the modules hold other Python numbers, parameter or buffer objects or forward hooks than the "
                    "recorded step's")
        if recording.global_slots is None:
            return "the last verified step did not record the values its forward reads from outside the model"
        changed = first_change(recording.global_slots, recording.global_values)
        return None if changed is None else f"a value the forward reads from outside the model changed ({changed})"

    def __exit__(self, exc_type, exc, tb) -> None:
        _ACTIVE.remove(self)
        try:
            if self.hook_only:
                self._exit_hook_only(exc_type)
            else:
                self._exit(exc_type, exc, tb)
                if exc_type is None:  # each complete verified step's recording is the one to replay
                    self.recording = self._finish_recording()
                    if self.recording.refusal is None:
                        self._program = self._build_program()
                        if self._program.refusal is not None:
                            self.recording = replace(self.recording, refusal=self._program.refusal)
                        else:
                            self._bind_program()
                self.report.hook_only_refusal = self.recording.refusal if self.recording is not None else None
        finally:
            for p, old in self._stashed:
                p.grad = old if p.grad is None else old.add_(p.grad)
            self._stashed = []

    def _check_inputs(self, _module, args, kwargs) -> None:
        if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call: no tree to walk
            inputs = list(args)
        else:
            inputs = [t for t in tree_leaves([args, kwargs]) if isinstance(t, torch.Tensor)]
        if self.checks_modules:
            self._check_arguments(args, kwargs)
            self._value_reads.begin_forward()
            if not self.hook_only:  # the generators the modules hold now, with Python's and NumPy's
                own = own_generators(self.model)
                self._draws_before = own, draw_states(own)
        self._step_inputs = inputs
        if self.hook_only and -1 in self.recording.rng_events:
            self._hook_only_rng[-1] = _rng_state()
        if [(t.shape, t.dtype) for t in inputs] != self._traced_inputs:
            raise PlanMismatchError(
                f"model inputs (shape, dtype) {input_signature(inputs)} differ from the traced "
                f"{self.graph.meta.get('input_signature')} of graph {self.graph.name!r}"
            )
        if self.checks_modules and not self.hook_only and self._global_reads is not None:
            self._global_reads.start()  # until the model's forward returns (`_read_values`)

    def _read_values(self, recorded: tuple | None) -> None:
        """A recomputing plan's step: the tensor values its model's forward reads into Python, recorded
        (`recorded` None) or checked against the verified step's (`eager.value_reads`); last in `_enter_*`,
        since it replaces `torch.Tensor`'s reading methods until the step exits."""
        self._draws_before = None
        self._module_hooks.append(self.model.register_forward_hook(self._end_forward, always_call=True))
        # A verified step whose recording a hook-only step may follow: the globals and closure values its
        # forward reads, recorded. Tracing Python calls costs a verified step 30-45 %, so not after a recording
        # that refused the hook-only steps (every step runs verified; a recording made without, its
        # `global_slots` None, is followed by another verified step).
        self._global_reads = None
        if recorded is None and (self.recording is None or self.recording.refusal is None):
            self._global_reads = GlobalReads()
            self._module_hooks.append(self.model.register_forward_hook(self._global_reads.stop, always_call=True))
        self._value_reads = ValueReads(recorded).__enter__()

    def _end_forward(self, *_: object) -> None:
        """Where the model's forward returns: the tensor values it read end (`eager.value_reads`); a verified
        step whose forward drew from Python's or NumPy's global generator, or from one its modules hold,
        refuses the hook-only steps (`slackswap.runtime.host_draws`)."""
        self._value_reads.end_forward()
        if self.hook_only or self._draws_before is None:  # None: the forward pre-hook raised before reading
            return
        (own, before), self._draws_before = self._draws_before, None
        drawn = drawn_from(before, draw_states(own), own)
        if drawn is not None:
            self._refuse(f"the model's forward draws from {drawn}: a recompute on hooks alone would replay the "
                         "verified step's numbers")

    def _check_arguments(self, args: tuple, kwargs: dict) -> None:
        """A recomputing plan's steps: the Python values the model is called with (`forward_arguments`).
        A hook-only step called with other values than the verified step's runs verified instead (it
        records them again); a verified step called with an object that is not a plain value refuses the
        hook-only steps (every step runs verified), since the numbers inside it cannot be compared."""
        arguments = forward_arguments(args, kwargs)
        call = len(self._arguments)
        if self.hook_only:
            recorded = self.recording.forward_arguments
            if call >= len(recorded) or recorded[call] != arguments:
                self._verify_instead(call)
        elif arguments:
            opaque = opaque_argument(args, kwargs)
            if opaque is not None:
                self._refuse(f"the model is called with {opaque}, not a tensor or a plain value: a recompute on "
                             "hooks alone would replay the numbers it held in the verified step")
        self._arguments.append(arguments)


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
