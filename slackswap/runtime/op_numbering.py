"""Where a running training step is in a plan: op positions on top of the torch profile's tensor identities.

Tensor names are the storage identities of the torch profile source
(`slackswap.profile.torch.identity.StorageIdentities`, docs/torch_profile.md): a storage is named
after the module call and ATen op output that created it, so a plan entry reads
``model.layers.0.attn/addmm#0:0``. The runtime runs that very dispatch mode over its real step.

What the identities do not give is *where* in the plan the step is, which the runtime needs to issue
a prefetch or run a recompute at the plan's position. `OpNumbering` adds it: every ATen call of the
step, in execution order, is one graph op named ``op{k}:{overload}`` (k: the call's sequence number),
except that an in-place call on a tensor the *current* op produced (CPU dropout's ``empty_like`` ->
``bernoulli_`` -> ``div_``) joins that op: the tensor only exists once all of them ran, and a
recompute must replay all of them. So does an in-place call on the outputs of the latest op that
created a storage when only calls that created none (views: `matmul`'s `_unsafe_view`) came in
between: `scores = q @ k.T; scores /= 4.0` is one op, bmm then div_, and a recompute of it yields
the version every later reader saw. A write after another storage was created is an op of its own,
and its target cannot be recomputed (`slackswap.planners.support.replay_rule`).
The rule reads schemas and storages, never values, so the same
model on the same input shapes with the same torch build numbers the same way in the capture
(`capture.py`) and in the run (`eager.verified`); anything else is a name or size the graph lacks.
Tensors whose storage no op of the step created (weights, the input batch) are not graph tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from slackswap.graph import PYTHON_CONSTANT_OPS
from slackswap.profile.torch.identity import leaves as tree_leaves

#: A version tag recorded in every captured graph and checked when a plan is applied; its text is kept
#: as first written (it names this module by its earlier name), so graphs captured before still match.
IDENTITY_SCHEME = "slackswap.profile.torch.identity + slackswap.runtime.identity ops/4"


def call_number(op_name: str) -> int:
    """'op22:aten.empty_like.default' -> 22: the ATen call's number in the step (the name `begin` gives)."""
    return int(op_name.split(":", 1)[0].removeprefix("op"))


@cache
def overload_of(op_name: str) -> torch._ops.OpOverload | None:
    """'op22:aten.empty_like.default' -> torch.ops.aten.empty_like.default (None when not resolvable)."""
    try:
        namespace, packet, overload = op_name.split(":", 1)[1].split(".")
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, ValueError):
        return None


def storage_address(t: torch.Tensor) -> int:
    """The address of `t`'s storage: reused once the storage is freed, so `OpNumbering` keeps a weak
    reference beside it (unlike `profile.torch.identity.storage_key`, the storage object's identity)."""
    return t.untyped_storage().data_ptr()


def writes_into(func: torch._ops.OpOverload) -> tuple[int, ...]:
    """Positional argument indices that `func` mutates (schema alias info with is_write)."""
    return tuple(
        i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )


def fresh_output_flags(func: torch._ops.OpOverload, out: object) -> list[bool]:
    """Per flattened output leaf: True when the schema says it aliases no input (a new storage), or
    the op lifts a constant made from Python data into the dispatcher (`PYTHON_CONSTANT_OPS`: its storage
    is new to the step although the schema says the output aliases the input)."""
    returns = func._schema.returns
    leaves = tree_leaves(out)
    if func._overloadpacket.__name__ in PYTHON_CONSTANT_OPS:
        return [True] * len(leaves)
    if len(returns) == 1:
        flag = returns[0].alias_info is None
        return [flag] * len(leaves)
    return [r.alias_info is None for r in returns][: len(leaves)] + [True] * max(0, len(leaves) - len(returns))


@dataclass(frozen=True)
class Begin:
    op: str
    #: True when the call starts a new graph op; False when it joins the current one (in place).
    new_op: bool
    #: Graph tensors the call reads (excluding tensors of its own op).
    reads: tuple[str, ...]


class OpNumbering:
    """Names ATen calls and the storages they create, one training step at a time."""

    def __init__(self, identities: object) -> None:
        """`identities`: the `StorageIdentities` dispatch mode running below this one."""
        self.identities = identities
        self.calls = 0
        self.current_op: str | None = None
        self.current_outputs: list[str] = []
        #: The latest op that created a storage and its outputs, while no later op created one.
        self._storage_op: tuple[str, list[str]] | None = None
        self._by_storage: dict[int, tuple[str, StorageWeakRef]] = {}

    def name_of(self, t: torch.Tensor) -> str | None:
        """The graph tensor whose storage `t` uses, or None (weights, inputs, empty storages)."""
        if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
            return None
        entry = self._by_storage.get(storage_address(t))
        if entry is None or entry[1].expired():
            return None
        return entry[0]

    def begin(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Begin:
        k = self.calls
        self.calls += 1
        targets = [args[i] for i in writes_into(func) if i < len(args)]
        joins = (
            self.current_op is not None
            and bool(targets)
            and all(self.name_of(t) in self.current_outputs for t in targets)
        )
        if not joins and targets and self._storage_op is not None and self.current_op is not None:
            op, outputs = self._storage_op
            if all(self.name_of(t) in outputs for t in targets):
                self.current_op, self.current_outputs, joins = op, outputs, True
        if not joins:
            self.current_op = f"op{k}:{func}"
            self.current_outputs = []
        reads: list[str] = []
        for leaf in tree_leaves((args, kwargs)):
            name = self.name_of(leaf) if isinstance(leaf, torch.Tensor) else None
            if name is not None and name not in self.current_outputs and name not in reads:
                reads.append(name)
        return Begin(self.current_op, not joins, tuple(reads))

    def end(self, func: torch._ops.OpOverload, out: object) -> list[tuple[int, str, torch.Tensor]]:
        """Register the call's fresh outputs: [(leaf index, tensor name, tensor)]."""
        fresh: list[tuple[int, str, torch.Tensor]] = []
        flags = fresh_output_flags(func, out)
        for i, (leaf, is_fresh) in enumerate(zip(tree_leaves(out), flags, strict=False)):
            if not (is_fresh and isinstance(leaf, torch.Tensor)) or leaf.untyped_storage().nbytes() == 0:
                continue
            storage = leaf.untyped_storage()
            if self.name_of(leaf) is not None:
                continue  # an output that aliases a live tensor despite the schema (defensive)
            name = self.identities.identity(leaf)
            if not name:
                continue  # the identities saw no new storage here (it aliases an input): not a tensor
            self.current_outputs.append(name)
            self._storage_op = (self.current_op, self.current_outputs)
            self._by_storage[storage.data_ptr()] = (name, StorageWeakRef(storage))
            fresh.append((i, name, leaf))
        return fresh

    def close_op(self) -> None:
        """No later call may join the current op (used at a backward node boundary)."""
        self.current_op = None
        self.current_outputs = []
        self._storage_op = None
