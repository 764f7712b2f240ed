"""The eager runtime's hook-only steps: a step on the saved-tensor hooks alone (docs/runtime.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves

from slackswap.plan import StepKind
from slackswap.runtime.copy_engines import (
    bind_offload,
    bind_prefetch,
)
from slackswap.runtime.eager.program import OFFLOAD, PREFETCH, RECOMPUTE, RELEASE, HookProgram, build_hook_program
from slackswap.runtime.eager.report import RunReport, _NoLedger
from slackswap.runtime.eager.views import _nothing_reached, _read, _rng_state, _whole
from slackswap.runtime.errors import PlanMismatchError
from slackswap.runtime.recording import TensorRef


class _HookOnlyStep:
    """The hook-only steps of `PlanRun` (`eager.run`): the program built from the verified step's
    recording, run on the saved-tensor hooks alone (docs/runtime.md, "Hook-only steps")."""

    def _build_program(self) -> HookProgram:
        return build_hook_program(self.recording, self.positions, getattr(self.copies, "needs_poll", True),
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
        # A recomputing plan's step checks the autograd node each handed-back tensor goes to (`Recording.unpack_nodes`).
        nodes = self.recording.unpack_nodes if self.checks_modules else (None,) * len(program.unpacks)
        self._hot_unpacks = tuple(
            (u.name, u.ops, u.copy, u.release, tuple((k, last, made, fetch[k]) for k, last, made in u.prefetches), node)
            for u, node in zip(program.unpacks, nodes, strict=True))
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

    def _enter_hook_only(self) -> None:
        """A step on the saved-tensor hooks alone: no dispatch mode, cost per saved tensor."""
        self.report = RunReport(verified=False)
        self.ledger = _NoLedger()
        self.current = None
        self.current_copy = {}
        self.held_tensors = {}
        self.hosts = {}
        self.members = self.recording.members
        self.internal = False
        self._hook_only_rng: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._step_inputs = []
        self._arguments: list[tuple] = []
        self._input_hook = self.model.register_forward_pre_hook(self._check_inputs, with_kwargs=True)
        self._module_hooks = []
        if self.checks_modules:  # a recompute replays the recorded modules' calls: the modules must be the same
            self._module_hooks = self.module_calls.check(self.recording.module_calls)
        self._hooks = contextlib.nullcontext()
        self._reached = _nothing_reached
        if not self.idle:  # a plan that keeps everything and moves nothing needs no hook at all
            pack, unpack, self._reached = self._step_hooks()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        if self.checks_modules:
            self._read_values(self.recording.value_reads)

    def _verify_instead(self, call: int) -> None:
        """From the model's forward pre-hook: this step calls the model with other Python values than the
        verified step did (`_check_arguments`), so it runs verified from here, recording them. Before the
        first pack of the step's first model call nothing has run on the hooks, and the verified step's
        hooks and dispatch mode take over; later, or under a saved-tensor hook the caller pushed after
        ours, the step is refused."""
        packs, _ = self._reached()
        ours = isinstance(self._hooks, torch.autograd.graph.saved_tensors_hooks)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False) if ours else None
        if call or packs or (ours and top != (self._hooks.pack_hook, self._hooks.unpack_hook)):
            raise PlanMismatchError(
                f"model call {call} of this step passes other Python values (numbers, strings, the arguments' "
                "structure) than the verified step's, after the step began on hooks alone: the plan's recomputes "
                "would replay the recorded values. Pass the values that change through the first model call "
                "of a step, or run every step verified (apply(..., verify=True))")
        self._value_reads.__exit__()
        self._hooks.__exit__(None, None, None)
        self._input_hook.remove()
        for handle in self._module_hooks:
            handle.remove()
        self.hook_only = False
        self._enter_verified()
        self.report.verified_because = ("the model is called with other Python values (numbers, strings, the "
                                        "arguments' structure) than the recorded step's")

    def _exit_hook_only(self, exc_type) -> None:
        if self.checks_modules:
            self._value_reads.__exit__()
        self._hooks.__exit__(None, None, None)
        self._input_hook.remove()
        for handle in self._module_hooks:
            handle.remove()
        packs_reached, unpacks_reached = self._reached()
        try:
            if exc_type is None:
                if self.checks_modules:
                    self._value_reads.check_complete()
                packs, unpacks = len(self._program.packs), len(self._program.unpacks)
                if not self.idle and (packs_reached, unpacks_reached) != (packs, unpacks):
                    raise PlanMismatchError(
                        f"this step saved {packs_reached} and read back {unpacks_reached} tensors; the verified step "
                        f"saved {packs} and read back {unpacks}: the code path changed (or backward did not run "
                        "inside the context). Capture and plan again for the new code path"
                    )
                self._run_ops(self._program.tail)
        finally:
            if self.checks_modules and self._value_reads.differed:  # the path depends on the data: verify from now on
                self.verify = True
                self._verify_why = ("a hook-only step read another tensor value than the verified step: the code "
                                    "path depends on the data")
            offloads, prefetches = self._program.transfers(packs_reached, unpacks_reached, exc_type is None)
            self.report.offloads += offloads
            self.report.prefetches += prefetches
            self.copies.close()
            self.held_tensors.clear()
            self.hosts.clear()
            self._hook_only_rng.clear()
            self._step_inputs = []

    def _run_ops(self, ops: tuple[tuple, ...]) -> None:
        """Run the plan's operations due at an event (`eager.program`: releases, transfer issues,
        recompute steps), in the order the plan puts them; tested most frequent first. The step's
        transfers are counted from the program when it exits (`HookProgram.transfers`)."""
        held, hosts, copies = self.held_tensors, self.hosts, self.copies
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
        held_tensors, hosts, rng_states = self.held_tensors, self.hosts, self._hook_only_rng
        copies, run_ops, copy_of, pack_mismatch = self.copies, self._run_ops, self._copy_of, self._pack_mismatch
        tensor_type, current_node = torch.Tensor, torch._C._current_autograd_node
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
                    held_tensors[holds] = copy
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
                wanted, ops, c, release, prefetches, node = hot_unpacks[u]
            except IndexError:  # not reached: the step's transfers are counted by the events reached
                raise PlanMismatchError(
                    f"backward reads back saved tensor {u + 1}; the verified step read back {len(hot_unpacks)}: "
                    "the code path changed. Capture and plan again") from None
            if node is not None and type(current_node()) is not node:
                raise PlanMismatchError(
                    f"backward node {type(current_node()).__name__} reads back saved tensor {u} where the verified "
                    f"step's {node.__name__} did: the code path changed between steps (a data-dependent branch), "
                    "and the plan's recomputes would replay the recorded calls. Run every step verified: "
                    "apply(..., verify=True), or the eager export")
            unpacks_reached = u + 1
            if prefetches:
                for offload, last, made, fetch in prefetches:
                    held_tensors[made] = fetch(hosts.pop(offload) if last else hosts[offload])
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
            held = held_tensors.get(c)
            if type(held) is not tensor_type:  # in flight (`InFlight`), or not held: `_copy_of` says which
                held = copy_of(c)
            if release:  # its last reader: autograd holds it from here for as long as backward reads it
                del held_tensors[c]
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

