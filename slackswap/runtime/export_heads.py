"""The cached result of an op whose output a later in-place op of its layer writes into (eager export).

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


class _Dead:
    """Stands for a head's output that was freed before the write (no cached value exists)."""


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


__all__ = ["head_outputs", "weak_outputs"]
