"""Reads of a tensor's value into Python inside the model's forward (`bool(t)`, `.item()`, `int(t)`,
`.tolist()`, `.numpy()`, `torch.equal`): what a recomputing plan's steps record and check (`ValueReads`).

Why: a hook-only step runs no dispatch mode, and its recomputes replay the verified step's recorded calls,
so they follow the verified step's code path with its Python values. A forward whose path depends on a
tensor's value packs the same shapes in the same order when the branch skips an op that saves nothing:
measured before this check, `if (x[0, 0] > 0).item(): h = h * 0.5` before a recomputed softmax gave a
silently wrong gradient on every hook-only step after the branch flipped, and `h / h.abs().max().item()`
on every hook-only step. So a recomputing plan's verified step records the bools the forward reads (a
Hugging Face decoder reads one: whether its attention mask may be skipped) and its hook-only steps raise
at the first that differs, before backward; a number read (int, float) before a call the plan recomputes
comes back different on most steps, so it refuses the hook-only steps instead (every step runs verified);
so does an array read (`.numpy()`, `numpy.asarray(t)` through `__array__`, DLPack): measured before it was
seen, `h / float(h.numpy().max())` was silently wrong on every hook-only step, as `.item()` was.
Reads are seen by replacing the reading methods of `torch.Tensor` (and `torch.equal`, `torch.allclose`,
`torch.is_nonzero`) while the step runs, on the step's thread and inside the model's forward only; a
read through another path (a tensor subclass's own method, a raw pointer) is not seen (docs/runtime.md,
"Hook-only steps").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from slackswap.runtime.errors import PlanMismatchError

_METHODS = ("__bool__", "item", "__int__", "__float__", "__index__", "__complex__", "tolist", "equal", "allclose",
            "is_nonzero", "numpy", "__dlpack__")
#: Reads that hand Python every value of the tensor at once: never compared, always a number read.
_ARRAY_READS = ("numpy", "__dlpack__")
_FUNCTIONS = ("equal", "allclose", "is_nonzero")
_REMEDY = ("This run verifies its later steps, and refuses a step off the captured graph at its first other call; "
           "the eager export (slackswap.runtime.export.PlanExport), whose checkpoints re-run each layer's own "
           "forward, runs such a model exact")


def _is_bool(value: object) -> bool:
    return type(value) is bool or (type(value) is list and all(type(v) is bool for v in value))


class ValueReads:
    """While entered, the reads of tensor values the model's forward makes on this thread: bools kept in
    order (`bools`), the first number read noted (`number`). With `recorded`, each bool read is checked
    against the recorded one at its position and a differing one raises `PlanMismatchError`."""

    def __init__(self, recorded: tuple | None = None) -> None:
        self.recorded = recorded
        self.bools: list[object] = []
        #: The first read of a number (not a bool) or an array in forward: how it was read.
        self.number: str | None = None
        self._depth = 0
        self._thread = threading.get_ident()
        #: A read differed from the recorded one (the step raised).
        self.differed = False
        self._saved: list[tuple[object, str, object]] = []

    def begin_forward(self) -> None:
        """The model's forward begins (its forward pre-hook)."""
        self._depth += 1

    def end_forward(self, *_: object) -> None:
        """The model's forward returned (a forward hook)."""
        self._depth = max(0, self._depth - 1)

    def __enter__(self) -> ValueReads:
        for owner, names in ((torch.Tensor, _METHODS), (torch, _FUNCTIONS)):
            for name in names:
                self._saved.append((owner, name, owner.__dict__.get(name)))
                setattr(owner, name, self._reading(name, getattr(owner, name)))
        return self

    def __exit__(self, *_: object) -> None:
        for owner, name, own in reversed(self._saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._saved.clear()

    def _reading(self, name: str, read: Callable) -> Callable:
        def reading(*args, **kwargs):
            value = read(*args, **kwargs)
            if self._depth and threading.get_ident() == self._thread:
                self._note(name, value)
            return value

        reading.__name__ = name
        return reading

    def _note(self, name: str, value: object) -> None:
        if name in _ARRAY_READS:
            self.number = self.number or f"an array ({name})"
            return
        if not _is_bool(value):
            self.number = self.number or f"a number ({name})"
            return
        k = len(self.bools)
        self.bools.append(value)
        if self.recorded is None or (k < len(self.recorded) and self.recorded[k] == value):
            return
        expected = repr(self.recorded[k]) if k < len(self.recorded) else "no such read"
        self.differed = True
        raise PlanMismatchError(
            f"the model's forward read a tensor's value as {value!r} ({name}, read {k} of the step); the verified "
            f"step read {expected} there: the code path depends on the data (a branch on a tensor, a Hugging Face "
            "attention mask that now has padding), and the plan's recomputes would replay the verified step's path. "
            f"{_REMEDY}")

    def check_complete(self) -> None:
        """At a hook-only step's end: fewer reads than the verified step's is another path too."""
        if self.recorded is not None and len(self.bools) < len(self.recorded):
            self.differed = True
            raise PlanMismatchError(
                f"the model's forward read {len(self.bools)} tensor values as bools; the verified step read "
                f"{len(self.recorded)}: the code path depends on the data, and the plan's recomputes would replay "
                f"the verified step's path. {_REMEDY}")


__all__ = ["ValueReads"]
