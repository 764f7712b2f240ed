"""Capture the graph of one real training step of a torch model, named by `op_numbering.OpNumbering`.

This is the runtime's own, minimal graph source: it runs the step for real (on whatever device the
model is on) and records what autograd actually saves, so the runtime's tests can plan and run any
small model. It times ops with the project's roofline (FLOPs of the matmuls, bytes moved by every
op but a view, which moves none: `moves_no_data`; the hardware's efficiencies), the same model as
`slackswap.profile`. The full tracer of the
torch profile source (docs/torch_profile.md) replaces it for large models; both name tensors the
way `OpNumbering` does.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from slackswap.graph import (
    BACKWARD_FRAMES_KEY,
    FORWARD_PHASES,
    LAYER_ARGUMENTS_KEY,
    LEAF_MODULE_CALLS_KEY,
    NO_LAYER,
    REWRITTEN_KEY,
    SAVED_EVENTS_BY_TENSOR_KEY,
    SAVED_PACKS_BY_LAYER_KEY,
    STATE_KEY,
    WEIGHT_GRADS_KEY,
    Graph,
    Op,
    OpClass,
    Phase,
    Tensor,
)
from slackswap.hardware import Hardware
from slackswap.profile.timing import op_duration_s
from slackswap.profile.torch.identity import StorageIdentities, addressed_bytes
from slackswap.profile.torch.layer_stacks import LayerStacks, find_layer_stacks, leaf_modules
from slackswap.runtime.collectives import CollectiveReleases
from slackswap.runtime.host_draws import draw_states, own_generators, set_draw_states
from slackswap.runtime.op_numbering import IDENTITY_SCHEME, OpNumbering, writes_into
from slackswap.runtime.replay_check import REPLAYABLE_STATE_WRITERS, model_line, own_generator

_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul"}
_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"}
_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def model_signature(model: torch.nn.Module) -> str:
    """sha256 over class name and every parameter's name, shape and dtype: another model differs."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:16]


def input_signature(inputs: Sequence[object]) -> list[list[object]]:
    return [[list(t.shape), str(t.dtype)] for t in tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)]


def _matmul_flops(base: str, args: tuple) -> float:
    if base in ("mm", "bmm"):
        a, b = args[0], args[1]
    elif base in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
    else:
        return 0.0
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def moves_no_data(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> bool:
    """True for a call that aliases its input and writes nothing: a view (`OpOverload.is_view`: the
    schema's output aliases an input, `view`, `t`, `detach`, `alias`, ...) or a call whose every tensor
    output shares an input's storage (`_unsafe_view`, whose schema says its output is fresh because the
    input is consumed). It reads and writes no memory, so its roofline time is the launch cost alone
    (`_duration_s`); the sizes of the storages it aliases, which the memory model reads, are untouched."""
    if func.is_view:
        return True
    if writes_into(func):
        return False
    outputs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
    if not outputs:
        return False
    inputs = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs))
              if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes() > 0}
    return all(x.untyped_storage().nbytes() > 0 and x.untyped_storage().data_ptr() in inputs for x in outputs)


class _Recorder(TorchDispatchMode):
    def __init__(self, numbering: OpNumbering, layer_of: Callable[[], int]):
        super().__init__()
        self.numbering = numbering
        self.layer_of = layer_of
        self.phase = Phase.FORWARD
        self.ops: dict[str, dict] = {}
        self.tensors: dict[str, dict] = {}
        self.pending_reads: list[str] = []
        self.backward_context: tuple[int, str] = (NO_LAYER, "")
        #: The layers whose ops packed the tensors unpacked since the last backward op began, and per
        #: backward op the layers it unpacked from (`BACKWARD_FRAMES_KEY`).
        self.pending_frames: set[int] = set()
        self.backward_frames: dict[str, set[int]] = {}
        #: Graph tensors autograd saved (pack hook).
        self.packed: set[str] = set()
        #: Real lifetimes: each live graph tensor's storage by weak reference, and the op after which
        #: each dead one was released (`poll_releases`, at every new op).
        self.watched: dict[str, StorageWeakRef] = {}
        #: Collectives' `Work`s until the program lets them go (`slackswap.runtime.collectives`).
        self.collectives = CollectiveReleases()
        self.released_after: dict[str, str] = {}
        #: The stand-ins autograd unpacked (tensor name, weak reference): a backward node holds what it
        #: unpacked until it finishes, which may be several ops after the one that reads it first.
        self.unpacked: list[tuple[str, StorageWeakRef]] = []
        #: Forward in-place writes a replay of the producer does not redo (`replay_rule`): graph tensor
        #: -> [writing op, model line]; and op -> [module state it writes, model line].
        self.rewritten: dict[str, list[str]] = {}
        self.state_writes: dict[str, list[str]] = {}

    def poll_releases(self) -> None:
        """Storages that died since the last new op were released after it; a stand-in released
        there makes that op a reader of its tensor (the node held it until then)."""
        if not self.ops:
            return
        last = next(reversed(self.ops))
        self.collectives.settle()
        for name in [n for n, ref in self.watched.items() if ref.expired()]:
            del self.watched[name]
            self.released_after[name] = last
        if self.unpacked:
            op = self.ops[last]
            alive = []
            for name, ref in self.unpacked:
                if not ref.expired():
                    alive.append((name, ref))
                elif name not in op["inputs"] and name not in op["outputs"]:
                    op["inputs"].append(name)
                    self.tensors[name]["consumers"].append(last)
            self.unpacked = alive

    def _note_writes(self, func, args: tuple, begin) -> None:
        """Record a forward in-place write that a recompute of its target's producer would not replay:
        into a graph tensor of an earlier op, or into module state (a buffer) other than the
        running statistics of a batch norm, which the runtime replays into scratch
        (`slackswap.runtime.replay_check`)."""
        for i in writes_into(func):
            t = args[i] if i < len(args) else None
            if not isinstance(t, torch.Tensor):
                continue
            name = self.numbering.name_of(t)
            if name is not None and begin.new_op and name not in self.rewritten:
                self.rewritten[name] = [begin.op, model_line()]
            elif name is None and func._overloadpacket.__name__ not in REPLAYABLE_STATE_WRITERS:
                self.state_writes.setdefault(begin.op, [f"argument {i} of {func}", model_line()])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        begin = self.numbering.begin(func, args, kwargs)
        if begin.new_op:
            self.poll_releases()
        if self.phase != Phase.BACKWARD and writes_into(func):
            self._note_writes(func, args, begin)
        if self.phase != Phase.BACKWARD and own_generator(func, args, kwargs) is not None:
            self.state_writes.setdefault(begin.op, ["(the torch.Generator it draws from)", model_line()])
        out = self.collectives.call(func, args, kwargs)
        fresh = self.numbering.end(func, out)
        if begin.new_op:
            layer, forward_op = NO_LAYER, ""
            if self.phase == Phase.BACKWARD:
                layer, forward_op = self.backward_context
            else:
                layer = self.layer_of()
            self.ops[begin.op] = {
                "phase": self.phase, "layer": layer, "inputs": [], "outputs": [], "flops": 0.0,
                "moved": 0, "dtype": None, "op_class": OpClass.ELEMENTWISE, "forward_op": forward_op,
            }
        op = self.ops[begin.op]
        reads = list(begin.reads)
        if self.phase == Phase.BACKWARD and begin.new_op:
            reads = self.pending_reads + reads
            self.pending_reads = []
            if self.pending_frames:
                self.backward_frames.setdefault(begin.op, set()).update(self.pending_frames)
                self.pending_frames = set()
        for name in reads:
            if (self.phase == Phase.BACKWARD and name not in self.packed
                    and self.ops[self.tensors[name]["producer"]]["phase"] != Phase.BACKWARD):
                continue  # a forward tensor autograd did not save, read for its shape (ones_like(loss))
            if name not in op["inputs"] and name not in op["outputs"]:
                op["inputs"].append(name)
                self.tensors[name]["consumers"].append(begin.op)
        for _, name, t in fresh:
            op["outputs"].append(name)
            self.tensors[name] = {"size": t.untyped_storage().nbytes(), "producer": begin.op,
                                  "consumers": [], "layer": op["layer"], "dtype": t.dtype}
            self.watched[name] = StorageWeakRef(t.untyped_storage())
        base = func._overloadpacket.__name__
        op["flops"] += _matmul_flops(base, args)
        if base in _MATMULS:
            op["op_class"] = OpClass.MATMUL
        elif base in _ATTENTION:
            op["op_class"] = OpClass.ATTENTION
        leaves = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
        if not moves_no_data(func, args, kwargs, out):
            op["moved"] += sum(addressed_bytes(x) for x in leaves)
        if op["dtype"] is None and leaves:
            op["dtype"] = leaves[0].dtype
        return out


@contextmanager
def loss_boundary(model: torch.nn.Module, identities: StorageIdentities) -> Iterator[None]:
    """Ops after the model's forward returns are the loss's (`<loss>` identities), as in the tracer."""
    handle = model.register_forward_hook(lambda _m, _a, _o: identities.enter_loss())
    try:
        yield
    finally:
        handle.remove()


def _layer_tracker(layers: LayerStacks, model: torch.nn.Module, stack: ExitStack) -> Callable[[], int]:
    """Index of the enclosing layer (`layer_stacks.find_layer_stacks`: the tracer's rule too)."""
    active: list[int] = []
    for i, layer in enumerate(layers.modules(model)):
        pre = layer.register_forward_pre_hook(lambda _m, _a, i=i: active.append(i) or None)
        post = layer.register_forward_hook(lambda _m, _a, _o: active.pop() and None or None)
        stack.callback(pre.remove)
        stack.callback(post.remove)
    return lambda: active[-1] if active else NO_LAYER


def _layer_arguments(layers: LayerStacks, model: torch.nn.Module, stack: ExitStack,
                     numbering: OpNumbering) -> dict[str, set[int]]:
    """Graph tensor -> the layers it is passed to (`LAYER_ARGUMENTS_KEY`), filled as the forward runs."""
    found: dict[str, set[int]] = {}

    def note(i: int, args: tuple, kwargs: dict) -> None:
        for x in tree_leaves((args, kwargs)):
            name = numbering.name_of(x) if isinstance(x, torch.Tensor) else None
            if name is not None:
                found.setdefault(name, set()).add(i)

    for i, layer in enumerate(layers.modules(model)):
        handle = layer.register_forward_pre_hook(lambda _m, a, k, i=i: note(i, a, k), with_kwargs=True)
        stack.callback(handle.remove)
    return found


def _aten(op_name: str) -> str:
    """'op12:aten.bmm.default' -> 'bmm' (the overload packet, as the torch profile names ops)."""
    return op_name.split(":", 1)[1].split(".")[1]


def _roles(ops: dict[str, dict]) -> list[str]:
    """Per op: the torch profile's attention-core role (so selective_recompute finds the core), else the
    ATen packet name. The rule is the profile's own (`assemble.forward_roles`), applied to these ops."""
    from types import SimpleNamespace

    from slackswap.profile.torch.assemble import forward_roles

    records = [SimpleNamespace(index=i, aten=_aten(name), phase=op["phase"], layer=op["layer"])
               for i, (name, op) in enumerate(ops.items())]
    core = forward_roles(SimpleNamespace(ops=records))
    return [core.get(r.index, r.aten) for r in records]


def _duration_s(op: dict, hardware: Hardware) -> float:
    """The profile's roofline (`slackswap.profile.timing.op_duration_s`) on the op's FLOPs and bytes."""
    return op_duration_s(op["flops"], op["moved"], op["op_class"], _DTYPE_KEYS.get(op["dtype"], "fp32"), hardware)


def capture_graph(
    model: torch.nn.Module,
    inputs: Sequence[object],
    loss_fn: Callable[[object], torch.Tensor],
    hardware: Hardware,
    name: str = "model",
) -> Graph:
    """Run one training step (forward, loss, backward) and return its graph.

    The step runs under `torch.random.fork_rng` (and Python's, NumPy's and the modules' own generators are
    put back: `host_draws`), the gradients it makes are cleared afterwards (any the parameters held before,
    earlier micro-batches', are put back) and the buffers it writes (a batch norm's running statistics) are
    restored, so capturing changes neither the caller's RNG streams nor the model: a trainer integration may
    capture a new batch shape in the middle of training.
    """
    own = own_generators(model)
    draws = draw_states(own)
    try:
        with _model_state_kept(model):
            return _capture_graph(model, inputs, loss_fn, hardware, name)
    finally:
        set_draw_states(draws, own)


@contextmanager
def _model_state_kept(model: torch.nn.Module) -> Iterator[None]:
    """For the duration, the parameters' gradients set aside, and each buffer's object and values kept:
    after it, the gradients are the ones before and every buffer holds its object and values again
    (measured before this: a capture ran a batch norm's running mean one update ahead of a plain run's)."""
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = [(m, n, b, b.detach().clone()) for m in model.modules() for n, b in m.named_buffers(recurse=False)]
    for p, _ in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in grads:
            p.grad = grad
        with torch.no_grad():
            for module, buffer_name, buffer, values in buffers:
                setattr(module, buffer_name, buffer)
                buffer.copy_(values)


def _capture_graph(model: torch.nn.Module, inputs: Sequence[object], loss_fn: Callable[[object], torch.Tensor],
                   hardware: Hardware, name: str) -> Graph:
    identities = StorageIdentities(model)
    numbering = OpNumbering(identities)
    layer_stacks = find_layer_stacks(model)
    with ExitStack() as stack:
        recorder = _Recorder(numbering, _layer_tracker(layer_stacks, model, stack))
        arguments = _layer_arguments(layer_stacks, model, stack, numbering)
        packed = recorder.packed
        stack.enter_context(loss_boundary(model, identities))

        events = [0, 0]  # saved-tensor packs and unpacks: the hook calls a hooked step makes
        # Pack events per layer (weights included): what each layer's checkpoint frame packs under the
        # export (`slackswap.experiment.measured_executor.export_counts`).
        packs_by_layer: dict[int, int] = {}
        events_by_tensor: dict[str, list[int]] = {}  # graph tensor -> [packs, unpacks]

        def pack(t: torch.Tensor) -> object:
            events[0] += 1
            layer = recorder.layer_of()
            if layer != NO_LAYER:
                packs_by_layer[layer] = packs_by_layer.get(layer, 0) + 1
            # Autograd gets a private copy of a graph tensor, not the tensor: what keeps the tensor's
            # storage alive is then what keeps it alive under any plan (the model's own variables, the
            # autograd engine's buffers), and its release is measured (`Tensor.held_until`).
            name_ = numbering.name_of(t)
            if name_ is None:
                return t
            packed.add(name_)
            events_by_tensor.setdefault(name_, [0, 0])[0] += 1
            with _disable_current_modes():
                copy = t.untyped_storage().clone()
            # The layer running the op that saves it: the checkpoint region whose frame would pack it.
            return (name_, copy, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), layer)

        def unpack(stand_in: object) -> torch.Tensor:
            events[1] += 1
            numbering.close_op()
            if isinstance(stand_in, torch.Tensor):
                return stand_in
            name_, copy, dtype, size, stride, offset, frame = stand_in
            events_by_tensor[name_][1] += 1
            if frame != NO_LAYER:
                recorder.pending_frames.add(frame)
            with _disable_current_modes():
                t = torch.empty(0, dtype=dtype, device=copy.device).set_(copy, offset, size, stride)
            recorder.unpacked.append((name_, StorageWeakRef(copy)))
            if name_ not in recorder.pending_reads:
                recorder.pending_reads.append(name_)
                # The backward node that unpacks a forward tensor differentiates the op of its layer.
                producer = recorder.tensors[name_]["producer"]
                recorder.backward_context = (recorder.ops[producer]["layer"], producer)
            return t

        # Calls of the modules without children: what a recomputing plan's hook-only step checks, one hook
        # call each (`slackswap.runtime.eager.module_calls`), priced by `runtime_host_counts`.
        leaf_calls = [0]

        def count_call(*_) -> None:
            leaf_calls[0] += 1

        for _, m in leaf_modules(model):
            stack.callback(m.register_forward_pre_hook(count_call).remove)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(identities)  # below the recorder: it names what the recorder's calls create
        stack.enter_context(recorder)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        out = model(*inputs)  # the parameters' gradients are None here (`_model_state_kept`)
        recorder.phase = Phase.LOSS
        loss = loss_fn(out)
        del out  # a training step keeps only the loss (runtime.train)
        if loss.dim() != 0:
            raise ValueError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}; a scalar loss is needed")
        recorder.phase = Phase.BACKWARD
        loss.backward()
        recorder.poll_releases()
        del loss
    # Outside the modes: reading a gradient (a DTensor's `to_local`) must add no op to the step.
    weight_grads = _weight_gradients(model, numbering, recorder)  # cleared by `_model_state_kept`

    saved = {t for t, info in recorder.tensors.items()
             if recorder.ops[info["producer"]]["phase"] in FORWARD_PHASES
             and any(recorder.ops[c]["phase"] == Phase.BACKWARD for c in info["consumers"])}
    never_read = sorted(packed - saved)
    roles = _roles(recorder.ops)
    ops = tuple(
        Op(name=op_name, phase=op["phase"], op_class=op["op_class"], layer=op["layer"],
           inputs=tuple(t for t in op["inputs"] if t not in weight_grads),
           outputs=tuple(t for t in op["outputs"] if t not in weight_grads), flops=op["flops"],
           moved_bytes=op["moved"], duration_s=_duration_s(op, hardware), forward_op=op["forward_op"],
           role=roles[i])
        for i, (op_name, op) in enumerate(recorder.ops.items())
    )
    held = _held_until(recorder)
    tensors = {
        t: Tensor(name=t, size_bytes=info["size"], producer=info["producer"], consumers=tuple(info["consumers"]),
                  layer=info["layer"], saved=t in saved, role=str(info["dtype"]).removeprefix("torch."),
                  held_until=held.get(t, ""))
        for t, info in recorder.tensors.items() if t not in weight_grads
    }
    layers = {op.layer for op in ops if op.layer != NO_LAYER}
    meta = {
        "source": "slackswap.runtime.capture",
        "identity_scheme": IDENTITY_SCHEME,
        "torch_version": torch.__version__,
        "model_signature": model_signature(model),
        "input_signature": input_signature(inputs),
        "aten_calls": numbering.calls,
        LEAF_MODULE_CALLS_KEY: leaf_calls[0],
        "saved_tensor_packs": events[0],
        "saved_tensor_unpacks": events[1],
        SAVED_EVENTS_BY_TENSOR_KEY: {t: list(n) for t, n in events_by_tensor.items() if t in recorder.tensors},
        SAVED_PACKS_BY_LAYER_KEY: [packs_by_layer.get(k, 0) for k in range(max(packs_by_layer, default=-1) + 1)],
        "packed_never_read": never_read,
        "weight_bytes_from_params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "hardware": hardware.name,
        WEIGHT_GRADS_KEY: weight_grads,
        "layer_stacks": list(layer_stacks.stacks),
        **({REWRITTEN_KEY: recorder.rewritten} if recorder.rewritten else {}),
        **({STATE_KEY: recorder.state_writes} if recorder.state_writes else {}),
        BACKWARD_FRAMES_KEY: {op: sorted(f) for op, f in recorder.backward_frames.items()},
        LAYER_ARGUMENTS_KEY: {t: sorted(layers_) for t, layers_ in arguments.items() if t in recorder.tensors},
    }
    weight_bytes = int(meta["weight_bytes_from_params"])
    return Graph(name=name, ops=ops, tensors=tensors, num_layers=max(len(layers), 1),
                 weight_bytes=weight_bytes, weight_grad_bytes=weight_bytes, meta=meta)


def _weight_gradients(model: torch.nn.Module, numbering: OpNumbering, recorder: _Recorder) -> dict[str, int]:
    """Graph tensor -> bytes, for each parameter's gradient storage the step made. A weight gradient is
    model state (`Graph.weight_grad_bytes`), not an activation, as in the traced graph
    (`profile.torch.tracer`): the captured graph leaves these out of its tensors and ops, so the same
    decisions cost the same activation bytes on both graphs, and lists them (`WEIGHT_GRADS_KEY`) so the
    runtime recognises them in its step. A storage the step made that becomes a gradient is one,
    whatever read it before (a gradient AccumulateGrad took over without a copy)."""
    out: dict[str, int] = {}
    for p in model.parameters():
        grad = p.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()  # a DTensor gradient (FSDP2): its local shard's storage
        name = numbering.name_of(grad) if grad is not None else None
        if name is not None and name in recorder.tensors:
            out[name] = int(recorder.tensors[name]["size"])
    return out


def _held_until(recorder: _Recorder) -> dict[str, str]:
    """Tensor -> the op after which the step released it, where that is later than its producer and
    every reader of its own phase (for a forward tensor, its forward readers: a plan that drops it
    frees its run copy after them unless the model still holds it). Alive at the end: the last op."""
    position = {name: i for i, name in enumerate(recorder.ops)}
    last = next(reversed(recorder.ops))
    held: dict[str, str] = {}
    for t, info in recorder.tensors.items():
        backward = recorder.ops[info["producer"]]["phase"] == Phase.BACKWARD
        touches = [position[info["producer"]]] + [
            position[c] for c in info["consumers"] if (recorder.ops[c]["phase"] == Phase.BACKWARD) == backward]
        released = recorder.released_after.get(t, last)
        if position[released] > max(touches):
            held[t] = released
    return held


def budget_fraction_bytes(keep_all_peak_bytes: int, fraction: float) -> int:
    return max(1, math.floor(keep_all_peak_bytes * fraction))
