"""Trace one training step (forward, loss, backward) of a module on meta tensors into records.

Records, not a `Graph`: a trace is device-independent apart from its kernel semantics, so one trace is
timed on any number of GPUs (`slackswap.profile.torch.assemble.graph_from_trace`).

- every aten op that creates a storage, writes one in place, or has FLOPs is recorded, with its
  phase, its innermost module and that module's layer (`layer_stacks.find_layer_stacks`, the rule the
  runtime's capture and export use too); pure views (view, transpose,
  detach, expand) create nothing and are folded into the storage they view;
- the saved set is what autograd really saves: a `saved_tensors_hooks` pack hook records the storage
  of every tensor autograd saves in forward and loss (so views of one storage count once); the
  unpack hook hands the storage to the next backward op, so a tensor autograd saves only for its
  shape still has its backward reader;
- backward ops get their layer from the autograd node that runs them
  (`torch._C._current_autograd_node`), labelled in forward with the module whose output reaches it
  first;
- weight gradients (`param.grad` storages) are not activations: their bytes count as traffic only;
- real lifetimes (`Trace.released_after`): when each graph storage is really released in eager
  execution. Each storage is watched through a weak reference, and at every recorded op the ones
  that died since the previous op are released after it. The pack hook hands autograd a private
  stand-in (a description of the tensor on meta, a copy elsewhere) rather than the tensor, so what
  keeps a storage alive is what would keep it alive under any plan: the model's own Python
  variables and the autograd engine's buffers, not autograd's saved tensors (a plan decides those).
  The model's output is dropped once the loss is computed, as a training loop does; the loss lives
  to the end. A storage still alive when backward ends is held to the end of the step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.flop_counter import flop_registry

from slackswap.errors import ConfigError, SlackSwapError
from slackswap.graph import OpClass, Phase
from slackswap.profile.torch.identity import (
    LOSS_PATH,
    ROOT_PATH,
    StorageIdentities,
    addressed_bytes,
    storage_key,
    tensor_leaves,
)
from slackswap.profile.torch.layer_stacks import LayerStacks, find_layer_stacks
from slackswap.profile.torch.semantics import KernelRouting, check_semantics, cpu_size_correction

_PATH_KEY = "slackswap_module"
_CALL_SUFFIX = re.compile(r"@\d+$")

MATMUL_OPS = frozenset({"mm", "addmm", "matmul", "_scaled_mm", "linear"})
ATTENTION_OPS = frozenset({
    "bmm", "baddbmm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
})


#: Aten ops that draw random numbers (their recompute must replay the RNG state).
RANDOM_OPS = frozenset({
    "native_dropout", "_fused_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like",
    "randint", "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_", "multinomial",
})
#: Fused attention kernels and the position of their dropout probability argument.
_ATTENTION_DROPOUT_ARG = {
    "_scaled_dot_product_flash_attention": 3, "_scaled_dot_product_flash_attention_for_cpu": 3,
    "_scaled_dot_product_efficient_attention": 5,
}


def is_random(aten: str, args: tuple) -> bool:
    """Whether the op draws random numbers: a sampling op, or a fused attention kernel with dropout."""
    if aten in RANDOM_OPS:
        return True
    position = _ATTENTION_DROPOUT_ARG.get(aten)
    return position is not None and len(args) > position and float(args[position]) > 0.0


class TraceError(SlackSwapError):
    """The traced step could not run: the message names the stage (forward, loss, backward)."""


class UntraceableOpError(TraceError, ConfigError):
    """An ATen op of the model's step failed on the trace's meta tensors (a data-dependent shape or value:
    `nonzero`, `.item()`; an op with no meta kernel): the model, as given, is one the tracer cannot
    follow. A bad input, not a crash: it names the op and the module path (`model.torch` is the field,
    exit code 2 on the CLI) and the run is recorded as failed."""

    def __init__(self, stage: str, op: str, path: str, exc: BaseException):
        self.op, self.path = op, path
        ConfigError.__init__(self, "model.torch", path, (
            f"the tracer cannot follow {op} in module {path!r} (the model's {stage}, on meta tensors): "
            f"{type(exc).__name__}: {exc}"))


@dataclass(frozen=True)
class TracedStorage:
    key: int
    #: The identity (slackswap.profile.torch.identity) for forward/loss storages; b<op>:<i> in backward.
    name: str
    size_bytes: int
    producer: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TracedOp:
    index: int
    aten: str
    phase: Phase
    module: str
    layer: int
    op_class: OpClass
    #: Graph storages read (inputs, in-place targets, unpacked saved tensors), first occurrence order.
    reads: tuple[int, ...]
    #: Storages this op created.
    creates: tuple[int, ...]
    flops: float
    #: Bytes of every tensor argument and result (views at their own size, a broadcast view at its
    #: distinct elements: `identity.addressed_bytes`), graph or not.
    moved_bytes: int
    #: The op draws random numbers (dropout): a recompute must replay its RNG state.
    random: bool = False
    #: Graph storages this op overwrites in place (a subset of `reads`).
    writes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    ops: tuple[TracedOp, ...]
    storages: dict[int, TracedStorage]
    #: Storages autograd saved in forward/loss (pack hook), graph storages only.
    saved: frozenset[int]
    weight_grads: frozenset[int]
    num_layers: int
    #: Module paths of the layer lists (`layer_stacks.find_layer_stacks`), in forward order.
    layer_stacks: tuple[str, ...]
    num_params: int
    param_bytes: int
    semantics: str
    dtype: str
    #: Parameters per transformer layer (NO_LAYER: embeddings, head, final norm), tied ones once.
    layer_params: dict[int, int]
    #: Storage key -> index of the op after which eager execution released it (module docstring);
    #: storages alive at the end of the step are absent.
    released_after: dict[int, int] | None = None


@dataclass(frozen=True)
class _Packed:
    """What autograd holds for a saved graph tensor while tracing: the storage's key, the view, and
    (off the meta device) a private copy of the storage's bytes; the tensor itself is not held."""

    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int
    device: torch.device
    copy: torch.UntypedStorage | None

    def tensor(self) -> torch.Tensor:
        with _disable_current_modes():
            storage = self.copy if self.copy is not None else torch.UntypedStorage(self.nbytes, device=self.device)
            return torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, self.offset, self.size,
                                                                              self.stride)


def op_class_of(aten: str) -> OpClass:
    if aten in MATMUL_OPS:
        return OpClass.MATMUL
    if aten in ATTENTION_OPS:
        return OpClass.ATTENTION
    return OpClass.ELEMENTWISE


class _Tracer(StorageIdentities):
    #: (op, module path) of the first ATen call that raised, for `UntraceableOpError`.
    failed_at: tuple[str, str] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except Exception:
            if self.failed_at is None:
                self.failed_at = (str(func), self.modules.current(self.outside))
            raise

    def __init__(self, model: torch.nn.Module, semantics: str, layers: LayerStacks):
        # Storages are not kept alive (their release is measured), so a freed storage's address may be
        # reused: `key` maps an address to the storage created there last, checked by a weak reference.
        super().__init__(model, keep_alive=False)
        self._by_address: dict[int, tuple[int, StorageWeakRef]] = {}
        self._watched: dict[int, StorageWeakRef] = {}
        self.released_after: dict[int, int] = {}
        #: Stand-ins autograd unpacked (storage key, weak reference): a backward node holds what it
        #: unpacked until it finishes, which may be several ops after the first that reads it; the op
        #: after which a stand-in dies reads its storage too (`extra_reads`, op index -> keys).
        self._unpacked: list[tuple[int, StorageWeakRef]] = []
        self.extra_reads: dict[int, list[int]] = {}
        self.semantics = semantics
        self.layers = layers
        self.phase = Phase.FORWARD
        self.ops: list[TracedOp] = []
        self.storages: dict[int, TracedStorage] = {}
        self.saved: set[int] = set()
        self.pending_unpacked: list[int] = []
        self._last_bwd_path = LOSS_PATH
        self._names = {id(m): (n or ROOT_PATH) for n, m in model.named_modules(remove_duplicate=False)}
        self._label_handles: list = []
        #: Storages made before the step (parameters, buffers, the inputs): never a graph tensor.
        self.external: set[int] = set()

    # -- autograd node labels (backward layer attribution) -------------------------------------------

    def __enter__(self):
        # Registered before the module stack's hooks, so the pre-hook still sees the enclosing module.
        self._label_handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._label_inputs),
            torch.nn.modules.module.register_module_forward_hook(self._label_outputs),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._label_handles:
            handle.remove()
        return super().__exit__(*exc)

    def _label_inputs(self, module, args) -> None:
        # Nodes created before a module starts belong to the enclosing module (e.g. the embedding
        # dropout in the root's own forward), not to the first layer that consumes them.
        if id(module) in self._names:
            label_nodes(args, _CALL_SUFFIX.sub("", self.modules.current(self.outside)))

    def _label_outputs(self, module, args, output) -> None:
        name = self._names.get(id(module))
        if name is not None:
            label_nodes(output, name)

    # -- storages and their lifetimes ------------------------------------------------------------------

    def key(self, t: torch.Tensor) -> int | None:
        """The key of the graph storage `t` uses; None for parameters, inputs and stand-ins."""
        entry = self._by_address.get(storage_key(t))
        if entry is None or entry[1].expired():
            return None
        return entry[0]

    def poll_releases(self) -> None:
        """Storages that died since the last recorded op are released after it."""
        last = len(self.ops) - 1
        dead = [k for k, ref in self._watched.items() if ref.expired()]
        for k in dead:
            del self._watched[k]
            self.released_after[k] = last
        if self._unpacked and last >= 0:
            alive = []
            for k, ref in self._unpacked:
                if ref.expired():
                    self.extra_reads.setdefault(last, []).append(k)
                else:
                    alive.append((k, ref))
            self._unpacked = alive

    # -- saved tensors -------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> object:
        key = self.key(t)
        if (key is None and t.device.type == "meta" and self.phase == Phase.FORWARD
                and storage_key(t) not in self.external):
            # A constant the model made from Python data with no call the mode saw (an index list on
            # meta; on a real device `lift_fresh` reaches the mode): named as the real run's
            # `lift_fresh` names it (`StorageIdentities.lift_constant`). A tensor the model holds as a
            # plain attribute (no buffer) on meta would be taken for one: register it as a buffer.
            self.lift_constant(t)
            key = self.key(t)
        if key is None:
            return t  # a parameter, a buffer or an input: not an activation
        if self.phase != Phase.BACKWARD:
            self.saved.add(key)
        copy = None
        if t.device.type != "meta":
            with _disable_current_modes():
                copy = t.untyped_storage().clone()
        return _Packed(key, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                       t.untyped_storage().nbytes(), t.device, copy)

    def unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        self.pending_unpacked.append(packed.key)
        t = packed.tensor()
        self._unpacked.append((packed.key, StorageWeakRef(t.untyped_storage())))
        return t

    # -- ops -------------------------------------------------------------------------------------------

    def on_op(self, func, args, kwargs, out, path, new) -> None:
        aten = func.overloadpacket.__name__
        if self.phase == Phase.BACKWARD:
            node = torch._C._current_autograd_node()
            path = node.metadata.get(_PATH_KEY, self._last_bwd_path) if node is not None else self._last_bwd_path
            self._last_bwd_path = path
        inputs = list(tensor_leaves((args, kwargs)))
        outputs = list(tensor_leaves(out))
        reads: dict[int, None] = {}
        for t in inputs:
            key = self.key(t)
            if key in self.storages and (self.phase != Phase.BACKWARD or key in self.saved
                                         or self.ops[self.storages[key].producer].phase == Phase.BACKWARD):
                # In backward a forward tensor autograd did not save is read for its shape only (the
                # gradient seed's ones_like(loss)): not a use that keeps it alive.
                reads[key] = None
        mutates = func._schema.is_mutable
        flops = 0.0
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            flops = float(formula(*args, **kwargs, out_val=out))
        if not new and not flops and not (mutates and reads):
            return  # a view, detach, or an op on non-graph tensors only
        self.poll_releases()
        index = len(self.ops)
        if self.phase == Phase.BACKWARD and self.pending_unpacked:
            for key in self.pending_unpacked:
                reads[key] = None
            self.pending_unpacked = []
        creates = []
        for address, t, ident, i in new:
            key = len(self.storages)
            ref = StorageWeakRef(t.untyped_storage())
            self._by_address[address] = (key, ref)
            self._watched[key] = ref
            size = t.untyped_storage().nbytes()
            if self.semantics == "cpu":
                corrected = cpu_size_correction(func, i, t, args)
                size = size if corrected is None else corrected
            name = ident or f"b{index}:{aten}:{i}"
            self.storages[key] = TracedStorage(key, name, int(size), index, str(t.dtype).removeprefix("torch."),
                                               tuple(t.shape))
            creates.append(key)
        moved = sum(addressed_bytes(t) for t in inputs) + sum(addressed_bytes(t) for t in outputs)
        written = tuple(dict.fromkeys(
            self.key(t) for t in outputs if self.key(t) in reads and self.key(t) not in creates)) \
            if mutates else ()
        self.ops.append(TracedOp(index, aten, self.phase, path, self.layers.layer_of(path), op_class_of(aten),
                                 tuple(reads), tuple(creates), flops, int(moved), is_random(aten, args), written))


def label_nodes(output: object, path: str) -> None:
    """Label every autograd node reachable from `output` not labelled yet (by an inner module) with `path`."""
    stack = [t.grad_fn for t in tensor_leaves(output) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        meta = node.metadata
        if _PATH_KEY in meta:
            continue
        meta[_PATH_KEY] = path
        stack.extend(n for n, _ in node.next_functions if n is not None)


def trace_step(
    model: torch.nn.Module,
    inputs: Sequence[object],
    loss_fn: Callable[[object], torch.Tensor],
    *,
    semantics: str = "cuda",
    dtype: str = "bf16",
    layers: LayerStacks | None = None,
) -> Trace:
    """Trace forward (`model(*inputs)`), loss (`loss_fn(output)`) and `loss.backward()` of `model`.

    `model` and `inputs` should live on the meta device (nothing is allocated); any device works, the
    tracer only looks at shapes and storages. `semantics`: whose kernels (see semantics.py).
    `layers`: the model's layers, by default `find_layer_stacks(model)` (the rule the runtime uses too).
    """
    check_semantics(semantics)
    layers = find_layer_stacks(model) if layers is None else layers
    params = {storage_key(p): p for p in model.parameters()}
    tracer = _Tracer(model, semantics, layers)
    tracer.external = {storage_key(t) for t in (*model.parameters(), *model.buffers(), *tensor_leaves(inputs))}
    with torch.autograd.graph.saved_tensors_hooks(tracer.pack, tracer.unpack), KernelRouting(semantics), tracer:
        try:
            output = model(*inputs)
        except Exception as exc:
            if tracer.failed_at is not None:
                raise UntraceableOpError("forward", *tracer.failed_at, exc) from exc
            raise TraceError(f"trace: the model's forward raised {type(exc).__name__}: {exc}") from exc
        tracer.phase = Phase.LOSS
        tracer.enter_loss()
        try:
            loss = loss_fn(output)
        except Exception as exc:
            raise TraceError(f"trace: the loss function raised {type(exc).__name__}: {exc}") from exc
        del output  # a training loop keeps only the loss (module docstring)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TraceError(f"trace: the loss must be a scalar tensor, got {shape}")
        if not loss.requires_grad:
            raise TraceError("trace: the loss does not require grad (no parameter reaches it)")
        label_nodes(loss, LOSS_PATH)
        tracer.phase = Phase.BACKWARD
        tracer.stop_identities()
        try:
            loss.backward()
        except Exception as exc:
            raise TraceError(f"trace: backward raised {type(exc).__name__}: {exc}") from exc
        tracer.poll_releases()
    if tracer.pending_unpacked and tracer.ops:
        last = tracer.ops[-1]
        tracer.ops[-1] = TracedOp(last.index, last.aten, last.phase, last.module, last.layer, last.op_class,
                                  tuple(dict.fromkeys(last.reads + tuple(tracer.pending_unpacked))), last.creates,
                                  last.flops, last.moved_bytes, last.random, last.writes)
    for index, keys in tracer.extra_reads.items():
        op = tracer.ops[index]
        reads = tuple(dict.fromkeys(op.reads + tuple(k for k in keys if k not in op.creates)))
        tracer.ops[index] = TracedOp(op.index, op.aten, op.phase, op.module, op.layer, op.op_class, reads,
                                     op.creates, op.flops, op.moved_bytes, op.random, op.writes)
    weight_grads = frozenset(tracer.key(p.grad) for p in params.values() if p.grad is not None)
    never_read = tracer.saved - {k for op in tracer.ops if op.phase == Phase.BACKWARD for k in op.reads}
    if never_read and tracer.ops:  # saved but no backward node ran: freed with the autograd graph, at the end
        last = tracer.ops[-1]
        tracer.ops[-1] = TracedOp(last.index, last.aten, last.phase, last.module, last.layer, last.op_class,
                                  last.reads + tuple(sorted(never_read)), last.creates, last.flops, last.moved_bytes,
                                  last.random, last.writes)
    layer_params: dict[int, int] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if storage_key(p) in seen:
            continue
        seen.add(storage_key(p))
        layer = layers.layer_of(name.rsplit(".", 1)[0] if "." in name else "")
        layer_params[layer] = layer_params.get(layer, 0) + p.numel()
    return Trace(
        ops=tuple(tracer.ops),
        storages=tracer.storages,
        saved=frozenset(tracer.saved),
        weight_grads=weight_grads,
        num_layers=layers.num_layers,
        layer_stacks=layers.stacks,
        num_params=sum(p.numel() for p in params.values()),
        param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
        semantics=semantics,
        dtype=dtype,
        layer_params=layer_params,
        released_after=dict(tracer.released_after),
    )
