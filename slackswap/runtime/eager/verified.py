"""The eager runtime's verified step: a dispatch mode sees every ATen call (docs/runtime.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from slackswap.graph import WEIGHT_GRADS_KEY
from slackswap.plan import Decision, StepKind
from slackswap.profile.torch.identity import StorageIdentities
from slackswap.runtime.capture import loss_boundary
from slackswap.runtime.collectives import CollectiveReleases
from slackswap.runtime.copy_engines import InFlight
from slackswap.runtime.eager.report import RunReport
from slackswap.runtime.eager.views import _read, _rng_state, _whole
from slackswap.runtime.errors import PlanMismatchError
from slackswap.runtime.ledger import SavedBytesLedger
from slackswap.runtime.op_numbering import OpNumbering
from slackswap.runtime.recording import InputRef, PackRecord, Recording, TensorRef, _Member
from slackswap.runtime.replay_check import WriteCounts, refuse_own_generator, scratch_state


def model_storages(model: torch.nn.Module) -> set[int]:
    """The model's own storages (parameters, buffers), by storage object (`_cdata`), not address.

    Under FSDP2 (`torch.distributed.fsdp.fully_shard`) a parameter is a DTensor whose storage is its
    local shard, and what a layer's ops read is the unsharded parameter: a view of the parameter's
    all-gather output, a storage FSDP2 keeps for the model's life, emptied (`resize_(0)`) after each
    use and all-gathered into again before the next. Its address changes with every refill and is
    null after the step, its storage object does not: a recompute that reads it reads that step's
    gathered weight, as the step itself did, so it is the model's state and not an activation."""
    tensors: list[torch.Tensor] = []
    for t in [*model.parameters(), *model.buffers()]:
        tensors.append(t.to_local() if hasattr(t, "to_local") else t)
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            tensors.extend(getattr(fsdp_param, "all_gather_outputs", ()))
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                tensors.append(unsharded.to_local() if hasattr(unsharded, "to_local") else unsharded)
    return {t.untyped_storage()._cdata for t in tensors}


class _VerifiedStep(TorchDispatchMode):
    """The verified step of `PlanRun` (`eager.run`): every ATen call under a dispatch mode, checked
    against the graph and placed on the plan, the ledger measured, the recording made."""

    def _enter_verified(self) -> None:
        self._packs: list[PackRecord] = []
        self._unpacks: list[tuple[int, str | None]] = []
        self._unpack_nodes: list[type] = []
        self._random_since_pack = False
        self._refusal: str | None = None
        self._packed_names: set[str] = set()
        self._step_inputs: list[torch.Tensor] = []
        self._arguments: list[tuple] = []
        self.identities = StorageIdentities(self.model)
        self.numbering = OpNumbering(self.identities)
        self.collectives = CollectiveReleases()
        self.ledger = SavedBytesLedger(self.trace, self.collectives.settle)
        #: The step's weight gradients (name -> bytes): model state, not graph tensors (`capture`).
        self._weight_grads: dict[str, int] = dict(self.graph.meta.get(WEIGHT_GRADS_KEY) or {})
        self.report = RunReport()
        self.pos = 0
        self.current: int | None = None
        self.current_copy: dict[str, int] = {}
        #: Per copy the runtime holds (`held_copies`), the tensor it holds it as, until its release.
        self.held_tensors: dict[int, Any] = {}
        #: Per offload issued: its host copy (`InFlight`, or the tensor of an inline copy), until the
        #: prefetch that frees it; and their bytes.
        self.hosts: dict[int, InFlight | torch.Tensor] = {}
        self._host_bytes = 0
        self.members: dict[str, list[_Member]] = {}
        #: Per offload: the device of its source (where its prefetches go), for the hook program.
        self._offload_devices: dict[int, torch.device] = {}
        #: Per graph tensor, the offloads issued from it in this step (`_refresh_offloads`).
        self._offloads_of: dict[str, list[int]] = {}
        self.internal = False
        self.versions = WriteCounts()
        if self.copies is None:
            self.copies = self._default_copies()
        self._input_hook = self.model.register_forward_pre_hook(self._check_inputs, with_kwargs=True)
        self._module_log, self._module_hooks = self.module_calls.record()
        self._loss_boundary = loss_boundary(self.model, self.identities)
        self._loss_boundary.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self.identities.__enter__()
        super().__enter__()
        self._issue(0)
        if self.checks_modules:
            self._read_values(None)

    def _exit(self, exc_type, exc, tb) -> None:
        if self.checks_modules:
            self._value_reads.__exit__()
            if self._global_reads is not None:
                self._global_reads.stop()
        super().__exit__(exc_type, exc, tb)
        self.identities.__exit__(exc_type, exc, tb)
        self._hooks.__exit__(exc_type, exc, tb)
        self._loss_boundary.__exit__(exc_type, exc, tb)
        self._input_hook.remove()
        for handle in self._module_hooks:
            handle.remove()
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
            self.held_tensors.clear()
            self.hosts.clear()
            self._last_members, self.members = self.members, {}
            self.ledger.poll(-1)
            self.report.ledger_peak_bytes = self.ledger.peak_bytes
            self.report.ledger_peak_step = self.ledger.peak_step
            self.report.device_peak_bytes = self.ledger.device_peak_bytes
            self.report.device_peak_step = self.ledger.device_peak_step
            self.report.weight_grad_peak_bytes = self.ledger.weight_grad_peak_bytes
            self.report.live_by_step = self.ledger.live_by_step
            self.report.device_live_by_step = self.ledger.device_live_by_step
            self.report.aten_calls = self.numbering.calls

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
                    "changed (the model, its inputs, its train/eval mode, a forward hook, a data-dependent branch, "
                    "or a value the model computes once and caches, such as BEiT's lru_cache'd relative position "
                    "index: the capture's forward, the first, ran ops later steps skip), or gradients "
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
                refuse_own_generator(func, args, kwargs, begin.op)
                rng = _rng_state()
                rng_event = None if self._random_since_pack else len(self._packs) - 1
                if rng_event is None:
                    self._refuse(f"random call {begin.op!r} follows another random call with no saved tensor "
                                 "between them: its RNG state has no hook to be read at")
            if self.checks_modules and self._value_reads.number is not None:
                self._refuse(f"the model's forward read {self._value_reads.number} from a tensor before "
                             f"{begin.op!r}, which the plan recomputes: a recompute on hooks alone would replay the "
                             "verified step's value")
            member = _Member(func, tree_map(self._to_spec, (args, kwargs)), rng, [], rng_event)
            self.members.setdefault(begin.op, []).append(member)
        if random:
            self._random_since_pack = True
        self.versions.note(func, args, begin.op, begin.new_op, self.numbering.name_of)
        out = self.collectives.call(func, args, kwargs)
        if not begin.new_op and self._offloads_of:
            self._refresh_offloads(func, args)
        op = self.graph.op_by_name[begin.op]
        for index, name, t in self.numbering.end(func, out):
            nbytes = t.untyped_storage().nbytes()
            if self._weight_grads.get(name) == nbytes:  # model state: counted apart from the activations
                self.ledger.track_weight_grad(t.untyped_storage())
                continue
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
                    self.held_tensors[c] = _whole(t.detach())
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
            self.held_tensors.pop(c, None)
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
        """Offloads, then prefetches; a prefetch that frees its host copy (`PlanPositions.frees_host`)
        lets it go as it is issued, the engine keeping what it reads until it lands. The host bytes
        held between the two are what `PlanPositions.host_live_bytes` says step `bucket` holds."""
        for k in self.offloads_at[bucket]:
            c = self.schedule.offload_copy[k]
            source = self.held_tensors[c]
            self.hosts[k] = host = self.copies.offload(source, k)
            self._host_bytes += (host.tensor if isinstance(host, InFlight) else host).nbytes
            self.versions.offloaded[k] = self.versions.total[self.plan.offloads[k].tensor]
            self._offload_devices[k] = source.device
            self._offloads_of.setdefault(self.plan.offloads[k].tensor, []).append(k)
            self.report.offloads += 1
        self.report.host_live_bytes[bucket] = self._host_bytes
        self.report.host_peak_bytes = max(self.report.host_peak_bytes, self._host_bytes)
        frees_host = self.positions.frees_host
        for k in self.prefetches_at[bucket]:
            offload = self.schedule.prefetch_offload[k]
            host = self.hosts.pop(offload) if frees_host[k] else self.hosts[offload]
            if frees_host[k]:
                self._host_bytes -= (host.tensor if isinstance(host, InFlight) else host).nbytes
            arriving = self.copies.prefetch(host, self._offload_devices[offload])
            c = self.schedule.prefetch_copy[k]
            tensor = self.plan.prefetches[k].tensor
            self.held_tensors[c] = arriving
            self.versions.copy[c] = self.versions.offloaded[offload]
            self.current_copy[tensor] = c
            self.ledger.track(arriving.storage if isinstance(arriving, InFlight) else arriving.untyped_storage(), c)
            self.report.prefetches += 1

    def _refresh_offloads(self, func, args: tuple) -> None:
        """After an in-place call joined to its tensor's producer op (`OpNumbering`), copy again the
        offloads already issued from that tensor, into the same host buffer. Why: the plan offloads a
        tensor after its producer op's step, and an op's own in-place calls may run after later view
        ops' steps (DeepSeek-V3's keys: `new_empty`, a slice view, `copy_`, a slice view, `copy_`); the
        copy made at the step holds the tensor before them, which autograd's unpack refuses
        (`WriteCounts.check`). The host bytes and the transfer's position stay the plan's; the hook-only
        steps offload at the tensor's pack, after those calls already."""
        from slackswap.runtime.op_numbering import writes_into

        for i in writes_into(func):
            name = self.numbering.name_of(args[i]) if i < len(args) else None
            for k in self._offloads_of.get(name, ()) if name is not None else ():
                if k not in self.hosts or self.versions.offloaded[k] == self.versions.total[name]:
                    continue
                self.internal = True
                try:
                    with _disable_current_modes():
                        held = self.held_tensors.get(self.schedule.offload_copy[k])  # the form offloaded
                        self.hosts[k] = self.copies.offload(_whole(args[i].detach()) if held is None else held, k)
                finally:
                    self.internal = False
                self.versions.offloaded[k] = self.versions.total[name]

    def _copy_of(self, c: int) -> torch.Tensor:
        """Copy `c` as held (`_whole` form); a prefetch not yet arrived is waited for."""
        held = self.held_tensors.get(c)
        if isinstance(held, InFlight):  # a transfer in flight (an inline copy is its tensor, arrived)
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
                if not self.hook_only and self.copy_source[c] == "run" and x.name not in self._packed_names:
                    self._refuse(f"plan step {j} ({step.op!r}) reads {x.name!r}, a tensor autograd does not save: "
                                 "no saved-tensor hook hands it over")
                if not self.hook_only:
                    self.versions.check(x.name, x.version, self._copy_version(c, x.name), f"plan step {j} "
                                        f"recomputes {step.op!r}, which reads")
                held = self._copy_of(c)
            return _read(held, x.dtype, x.size, x.stride, x.offset)

        self.internal = True
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                for m in members:
                    rng = m.rng if not self.hook_only or m.rng is None else self._hook_only_rng[m.rng_event]
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
            self.held_tensors[c] = env[name]
            self.current_copy[name] = c
            if not self.hook_only:
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
        self._unpack_nodes.append(type(torch._C._current_autograd_node()))
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

    def _global_record(self) -> dict[str, tuple | None]:
        """The recording's global and closure slots and their values (`eager.global_reads`): none to check
        for a plan that recomputes nothing; slots None (unknown: the next step runs verified) where this step
        did not trace them."""
        if not self.checks_modules:
            return {}
        if self._global_reads is None:
            return {"global_slots": None}
        return {"global_slots": tuple(self._global_reads.slots), "global_values": tuple(self._global_reads.values)}

    def _finish_recording(self) -> Recording:
        """After a complete verified step: what the hook-only steps need. Arguments of recomputed calls
        that are not graph tensors must be parameters or buffers (the same storage every step) or
        model inputs (taken from each step's forward pre-hook); anything else refuses."""
        owned = model_storages(self.model)
        inputs = {t.untyped_storage().data_ptr(): i for i, t in enumerate(self._step_inputs)}

        def external(x: object, op: str) -> object:
            if not isinstance(x, torch.Tensor):
                return x
            if x.untyped_storage()._cdata in owned:
                return x
            ptr = x.untyped_storage().data_ptr()
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
        return Recording(tuple(self._packs), tuple(self._unpacks), members, events, self._refusal,
                         module_calls=tuple(self._module_log), module_state=self._module_state,
                         forward_arguments=tuple(self._arguments),
                         value_reads=tuple(self._value_reads.bools) if self.checks_modules else (),
                         **self._global_record(),
                         unpack_nodes=tuple(self._unpack_nodes))
