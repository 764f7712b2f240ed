"""Stable identities for the storages a training step creates: shared by the tracer and the runtime.

A plan names saved tensors; the runtime must find, among the tensors autograd really saves on
the GPU, the one a plan entry means. Both sides run a `StorageIdentities` dispatch mode over the
forward and loss, and name every storage after the aten op output that first created it:

    <module path>[@<call>]/<aten op>#<k>:<output index>

- module path: the innermost `nn.Module` running when the op ran, as `model.named_modules()` names it
  (`model.layers.3.self_attn`); `<root>` for the root module's own ops, `<loss>` for ops of the loss
  function (outside every module); `@<call>` is appended from a module's second call on (call 0 has no
  suffix), so a module called twice in one step keeps both calls apart;
- aten op: the overload packet name (`mm`, `native_dropout`, `_scaled_dot_product_flash_attention`);
- k: how many ops of that name ran before it in the same module call (all ops count, views too);
- output index: the position of the tensor among the op's tensor outputs (flattened).

The identity is local to one module call: a kernel that differs in one module (another attention
backend) changes only identities inside that module. Views and in-place writes do not create a
storage, so q, k and v split from one fused projection share its output's identity. A constant made
inside forward from Python data (`torch.tensor(...)`, or the index tensor of `x[..., [-2], :]`) is
created outside the dispatcher and enters it through `lift_fresh`, whose output aliases its input:
the mode names that storage after the `lift_fresh` call (`slackswap.graph.PYTHON_CONSTANT_OPS`), so an index tensor
autograd saves (Falcon's `fused_qkv[..., [-2], :]`) is a graph tensor with its bytes, not an
anonymous tensor kept unseen. See docs/torch_profile.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import SUPPORTED_NODES, is_namedtuple_class, tree_leaves

from slackswap.graph import PYTHON_CONSTANT_OPS

ROOT_PATH = "<root>"
LOSS_PATH = "<loss>"


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (views share it). Valid while the storage is alive."""
    return tensor.untyped_storage()._cdata


#: Per type: is it a pytree leaf (not a registered node, not a namedtuple)? Emptied when a node type is
#: registered. See `leaves`.
_LEAF_TYPES: dict[type, bool] = {}
_NODE_TYPES_SEEN = [0]


def leaves(tree: object) -> list:
    """`torch.utils._pytree.tree_leaves(tree)`: the same leaves in the same order, faster on what a dispatch
    mode meets. Why: the runtime and the tracer flatten every ATen call's arguments and outputs (several
    times a call), and pytree's generic walk (a namedtuple check per leaf, a generator per node) was an
    eighth of a verified step's CPU time on the zoo. Exact tuples, lists and dicts are walked here, as
    pytree flattens them (elements in order, a dict's values in insertion order); a leaf's type is looked
    up once (`_LEAF_TYPES`); any other node (torch.Size, a namedtuple, an op's structseq result, a
    registered class) is flattened by pytree itself."""
    if len(SUPPORTED_NODES) != _NODE_TYPES_SEEN[0]:
        _LEAF_TYPES.clear()
        _NODE_TYPES_SEEN[0] = len(SUPPORTED_NODES)
    out: list = []
    _collect(tree, out)
    return out


def _collect(tree: object, out: list) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for x in tree:
            if _LEAF_TYPES.get(type(x)):
                out.append(x)
            else:
                _collect(x, out)
    elif kind is dict:
        for x in tree.values():
            _collect(x, out)
    else:
        leaf = _LEAF_TYPES.get(kind)
        if leaf is None:
            leaf = _LEAF_TYPES[kind] = kind not in SUPPORTED_NODES and not is_namedtuple_class(kind)
        if leaf:
            out.append(tree)
        else:
            out.extend(tree_leaves(tree))


def tensor_leaves(tree: object) -> Iterator[torch.Tensor]:
    return (x for x in leaves(tree) if isinstance(x, torch.Tensor))


def addressed_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads or writes through `t`: its distinct elements. A broadcast view (`expand`,
    stride 0) repeats elements a kernel fetches once, so counting its full view size charged, e.g.,
    the backward of HF's RMSNorm `mean` a whole fp32 activation it never reads (67 MB per Llama-7B
    layer, docs/profile.md "Traced against analytic")."""
    elements = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            elements *= size
    return min(elements, t.numel()) * t.element_size()


class ModuleStack:
    """The innermost running module's path and call index, kept by global forward (pre-)hooks."""

    def __init__(self, model: torch.nn.Module):
        self._names = {id(m): (name or ROOT_PATH) for name, m in model.named_modules(remove_duplicate=False)}
        self._calls: dict[str, int] = defaultdict(int)
        self.stack: list[str] = []
        self._handles: list = []

    def __enter__(self) -> ModuleStack:
        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module, args) -> None:
        name = self._names.get(id(module))
        if name is None:
            return
        call = self._calls[name]
        self._calls[name] += 1
        self.stack.append(name if call == 0 else f"{name}@{call}")

    def _post(self, module, args, output) -> None:
        if id(module) in self._names and self.stack:
            self.stack.pop()

    def current(self, outside: str) -> str:
        return self.stack[-1] if self.stack else outside


class StorageIdentities(TorchDispatchMode):
    """Dispatch mode naming every new storage created in forward and loss (see the module docstring).

    Use (the runtime's side; the tracer does the same):

        with StorageIdentities(model) as ids:
            out = model(*inputs)
            ids.enter_loss()
            loss = loss_fn(out)
            ids.stop_identities()
            loss.backward()

    and in a `saved_tensors_hooks` pack hook `ids.identity(t)` names the saved tensor (or view) by its
    storage: None for storages not created under the mode (parameters, buffers, user inputs).
    Subclasses hook `on_op`.
    """

    def __init__(self, model: torch.nn.Module, *, keep_alive: bool = False):
        """`keep_alive`: hold every storage created, so no key is ever reused (the meta tracer: free).
        Without it (a real run) a freed storage's key may be reused; a weak reference tells them apart."""
        super().__init__()
        self.modules = ModuleStack(model)
        self.outside = ROOT_PATH
        self.recording_identities = True
        self._counts: dict[tuple[str, str], int] = defaultdict(int)
        self._ids: dict[int, tuple[object, str]] = {}
        self._keep_alive = keep_alive
        self._kept: list = []

    def __enter__(self):
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self.modules.__exit__(*exc)
        return super().__exit__(*exc)

    def enter_loss(self) -> None:
        """Ops run from now on outside the model belong to the loss (`<loss>`)."""
        self.outside = LOSS_PATH

    def stop_identities(self) -> None:
        """Backward: storages created from now on get no identity (they are never plan entries)."""
        self.recording_identities = False

    def identity(self, tensor: torch.Tensor) -> str | None:
        """The tensor's storage identity; '' for a storage created in backward; None if not created here."""
        entry = self._ids.get(storage_key(tensor))
        if entry is None or (entry[0] is not None and entry[0].expired()):
            return None
        return entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        before = set() if name in PYTHON_CONSTANT_OPS else {storage_key(t) for t in tensor_leaves((args, kwargs))}
        out = func(*args, **kwargs)
        self._name_outputs(func, args, kwargs, out, before)
        return out

    def lift_constant(self, tensor: torch.Tensor) -> None:
        """Name `tensor` as the `lift_fresh` call that a real device makes for it would (`on_op` runs).

        On the meta device the index tensor of `x[..., [-2], :]` is made without any call reaching a
        dispatch mode; the tracer meets it only when autograd saves it, right before the indexing op,
        where the real run's `lift_fresh` came. Naming it here keeps both sides' identities equal."""
        self._name_outputs(torch.ops.aten.lift_fresh.default, (tensor,), {}, tensor, set())

    def _name_outputs(self, func, args: tuple, kwargs: dict, out: object, before: set[int]) -> None:
        path = self.modules.current(self.outside)
        name = func.overloadpacket.__name__
        new: list[tuple[int, torch.Tensor, str, int]] = []
        if self.recording_identities:
            k = self._counts[(path, name)]
            self._counts[(path, name)] = k + 1
            prefix = f"{path}/{name}#{k}"
        else:
            prefix = ""
        for i, t in enumerate(tensor_leaves(out)):
            key = storage_key(t)
            if key in before or self.identity(t) is not None:
                continue
            ident = f"{prefix}:{i}" if prefix else ""
            storage = t.untyped_storage()
            if self._keep_alive:
                self._kept.append(storage)
                self._ids[key] = (None, ident)
            else:
                self._ids[key] = (StorageWeakRef(storage), ident)
            new.append((key, t, ident, i))
        self.on_op(func, args, kwargs, out, path, new)

    def on_op(self, func, args, kwargs, out, path: str, new: list) -> None:
        """Called after every op with the storages it created: (key, tensor, identity or '', output index)."""
