"""What the eager export's checkpoint caches hold, beyond the plan.

`cached_differences`: the differences read from what the step's caches really hold (each cached
storage named by the op output that made it), not from what the policy meant: selective
checkpointing caches every output of an op it saves (LayerNorm's and BatchNorm's outputs beside their
saved statistics, topk's values beside its indices), so a storage the plan does not keep can be held.

`head_outputs` / `weak_outputs`: the cached result of an op whose output a later in-place op of its
layer writes into.

Why: the export's eager checkpoint saves such an op (the head of an in-place chain: CPU dropout's
`empty_like`, Mixtral's `topk` whose values are divided in place) with the tensor as it stands after
the writes, so the replay hands the caller the final tensor. The cache must have the op's own output
structure: `topk` returns (values, indices), and a replay that returned the values alone breaks the
caller's unpacking. The forward keeps only weak references to the head's outputs until a write turns
the head into a saved one (holding them would keep every head's outputs alive to the layer's end, which
no plan prices); an output freed before the write has no cached value, and the step is refused there
with the op's name rather than replayed with a wrong tensor.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_map

#: `ExportDifference.reason` of a storage a cache holds that the plan does not keep.
CACHED_WITH_OP = ("cached with its op: selective checkpointing saves every output of an op it saves (LayerNorm's "
                  "and BatchNorm's outputs beside their statistics, topk's values beside its indices); "
                  "plan_for_export decides an op's outputs alike and prices them")


def name_storages(names_of: dict, named: list, leaves: list) -> None:
    """Name each output storage of an op by the op's identity, unless a live storage there is named
    already (`_unsafe_view` says its output is fresh but shares its input's storage: the storage keeps
    the name of the op that made it). A dead entry (its address reused) is replaced."""
    from torch.multiprocessing.reductions import StorageWeakRef

    for name, i in named:
        storage = leaves[i].untyped_storage()
        key = storage._cdata
        entry = names_of.get(key)
        if entry is None or entry[1].expired():
            names_of[key] = (name, StorageWeakRef(storage))


def cached_differences(saved_storages: dict, names_of: dict, decisions: dict, named: set) -> list[tuple]:
    """(tensor, decision, exported, reason) of an `ExportDifference` per storage the step's caches held
    whose identity the plan does not keep (and no earlier difference named): decision "none" for a
    tensor the plan does not decide."""
    from slackswap.plan import Decision

    out = []
    for storage in saved_storages:
        name = names_of.get(storage, (None,))[0]
        if name is None or name in named or decisions.get(name) == Decision.KEEP:
            continue
        named.add(name)
        out.append((name, str(decisions.get(name, "none")), "saved", CACHED_WITH_OP))
    return out


def weak_outputs(out: object) -> object:
    """`out` with each tensor a weak reference (the other leaves as they are)."""
    return tree_map(lambda x: weakref.ref(x) if isinstance(x, torch.Tensor) else x, out)


def head_outputs(shape: object, key: tuple) -> object:
    """The head's outputs (detached, at their current version) from `weak_outputs`; an output already freed
    raises (`RuntimeError` naming the op: the step is refused, not run inexactly)."""

    def resolve(x: object) -> object:
        if isinstance(x, weakref.ref):
            t = x()
            if t is None:
                raise RuntimeError(
                    f"{key[0]} call {key[1]}: an output of this op was freed before an in-place op of its layer "
                    "wrote into another; the export cannot replay the op exactly")
            return t.detach()
        return x

    return tree_map(resolve, shape)


__all__ = ["CACHED_WITH_OP", "cached_differences", "head_outputs", "name_storages", "weak_outputs"]
