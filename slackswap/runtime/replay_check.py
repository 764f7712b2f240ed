"""A recompute yields the tensor at the version autograd saved, or the verified step refuses the plan.

Why version counts of our own and not only `Tensor._version`: autograd's counter belongs to a view
family, and an op such as `_unsafe_view` (what `matmul` returns) starts a new family on the same
storage, so `scores = q @ k.T; scores /= 4.0` bumps a counter the bmm output never sees. The
verified step's dispatch mode sees every ATen call, so `WriteCounts` counts in-place writes per
graph storage (`OpNumbering` names): `total` (every write so far) and `own` (the writes by calls of
the storage's producer op, which a recompute replays). A copy of a tensor is then at a known count:
a run copy at the live `total` (it is the storage), a recompute copy at `own` (the replay redoes
exactly those), a prefetched copy at `total` when its offload was issued. Every read of a recompute
(`TensorRef.version`, the count the forward call read) and every unpack of a swapped or recomputed
tensor (the count autograd packed) is checked against the copy it gets; a difference raises
`InexactRecomputeError` naming the op, the tensor (whose name is its module path and ATen op) and
the model line of the write. The planners' rule (`slackswap.planners.support.replay_rule`) keeps
such tensors out of every plan; this check is what makes a plan made without it fail loudly.

Module state: a batch norm in training mode updates its running statistics in place (its schema
does not say so). Its outputs do not depend on them (batch statistics), so a replay passes scratch
clones of them (`scratch_state`): the buffers are updated once, by the forward, and the recomputed
outputs are bit-identical. Any other op that writes a tensor that is not its own output (module
state) is refused in the verified step (and the capture marks its outputs not replayable).

A random call that draws from a `torch.Generator` the model passes (`torch.rand(..., generator=g)`,
`bernoulli(p, generator=g)`) writes that generator's state, which is module state in the same sense: a
replay restores only the default generators' state (what `torch.random.fork_rng` forks), so it would
draw other numbers and advance the model's generator a second time. Measured before this rule: a
dropout mask drawn from a module's own generator and recomputed changed the gradient on every step,
verified ones included. The capture marks such a call as writing module state (`own_generator`), and
the verified step refuses a plan that recomputes one (`refuse_own_generator`).
"""

from __future__ import annotations

import functools
import traceback
from collections import Counter

import torch

from slackswap.errors import SlackSwapError

#: Batch norms: positional indices of the running statistics they update in training mode, whose
#: value their outputs do not depend on (PyTorch's native_batch_norm family; schemas from
#: aten/src/ATen/native/native_functions.yaml).
STATE_WRITES: dict[str, tuple[int, ...]] = {
    "native_batch_norm": (3, 4), "_native_batch_norm_legit": (3, 4), "_batch_norm_with_update": (3, 4),
    "cudnn_batch_norm": (3, 4), "miopen_batch_norm": (3, 4),
}
REPLAYABLE_STATE_WRITERS = frozenset(STATE_WRITES)

#: Frames that are not the model's code: torch, the project's machinery (its zoo of models is model
#: code), the standard library's context managers.
_SKIP = ("/torch/", "/contextlib.py", "/transformers/utils/", "<frozen")


class InexactRecomputeError(SlackSwapError):
    """The plan recomputes or swaps a tensor whose copy would not be the version the step used."""


def own_generator(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> torch.Generator | None:
    """The generator a random call draws from when it is not a default one (the model's own), else None."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Generator) and x is not torch.default_generator and not _is_default_cuda(x):
            return x
    return None


def _is_default_cuda(generator: torch.Generator) -> bool:
    return generator.device.type == "cuda" and generator is torch.cuda.default_generators[generator.device.index or 0]


def refuse_own_generator(func: torch._ops.OpOverload, args: tuple, kwargs: dict, op: str) -> None:
    """Raise when the plan would recompute `op`, a random call drawing from the model's own generator."""
    if own_generator(func, args, kwargs) is not None:
        raise InexactRecomputeError(
            f"the plan recomputes {op!r}, a random call ({func}) that draws from a torch.Generator the model "
            "passes: a replay restores only the default generators' state, so it would draw other numbers and "
            "advance that generator again. Keep its outputs (slackswap's planners do, on a captured graph)")


def model_line() -> str:
    """'file:line (function)' of the innermost frame of the model's own code (not torch's, not ours)."""
    for frame in reversed(traceback.extract_stack()):
        own = "/slackswap/" in frame.filename and not frame.filename.endswith("/runtime/zoo.py")
        if not own and not any(s in frame.filename for s in _SKIP):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "<unknown line>"


@functools.cache
def _written(func: torch._ops.OpOverload) -> tuple[int, ...]:
    """Arguments `func` writes: its schema's, and a batch norm's running statistics (once per overload:
    a hook-only step's replay asks per recomputed call)."""
    from slackswap.runtime.op_numbering import writes_into

    extra = STATE_WRITES.get(func._overloadpacket.__name__, ())
    return tuple(sorted(set(writes_into(func)) | set(extra)))


def scratch_state(func: torch._ops.OpOverload, spec_args: tuple, args: tuple, is_ref) -> tuple:
    """`args` of a replayed call with every written argument that is not a graph tensor (module state:
    `spec_args[i]` not a graph-tensor reference) replaced by a clone, so the replay does not write it
    again. Raises for an op not known to leave its outputs independent of that state."""
    idx = [i for i in _written(func) if i < len(args) and isinstance(args[i], torch.Tensor)
           and not is_ref(spec_args[i])]
    if not idx:
        return args
    if func._overloadpacket.__name__ not in REPLAYABLE_STATE_WRITERS:
        raise InexactRecomputeError(
            f"the recompute of {func} would write module state (argument {idx[0]}) a second time: "
            "keep its outputs (plans from slackswap's planners do, on a captured graph)")
    out = list(args)
    for i in idx:
        out[i] = args[i].clone()
    return tuple(out)


def scratch_running_statistics(func: torch._ops.OpOverload, args: tuple) -> tuple:
    """`args` of a batch norm's replay with its running statistics (`STATE_WRITES`) as scratch clones: the
    export's replay of a layer runs the call a second time, and its outputs (training mode: the batch's
    statistics) do not depend on them. Other calls' `args` unchanged."""
    positions = STATE_WRITES.get(func._overloadpacket.__name__)
    if not positions:
        return args
    return tuple(a.clone() if i in positions and isinstance(a, torch.Tensor) else a for i, a in enumerate(args))


class WriteCounts:
    """Per graph tensor: in-place writes so far (`total`), those by its producer's calls (`own`), where
    the latest write after the producer came from (`writer`), and per copy the count it holds."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.own: Counter[str] = Counter()
        self.writer: dict[str, tuple[str, str]] = {}
        self.copy: dict[int, int] = {}
        #: Per offload issued: the count its source held then.
        self.offloaded: dict[int, int] = {}

    def note(self, func, args: tuple, op: str, new_op: bool, name_of) -> None:
        """Before an ATen call of op `op` (`new_op`: it starts the op) runs: count its writes."""
        from slackswap.runtime.op_numbering import writes_into

        for i in writes_into(func):
            name = name_of(args[i]) if i < len(args) and isinstance(args[i], torch.Tensor) else None
            if name is None:
                continue
            self.total[name] += 1
            if new_op:
                self.writer[name] = (op, model_line())
            else:
                self.own[name] += 1

    def check(self, tensor: str, expected: int, actual: int, what: str) -> None:
        if expected == actual or expected < 0:
            return
        if tensor in self.writer:
            op, line = self.writer[tensor]
            who = f"op {op!r} at {line} writes it in place after its producer"
        else:  # only calls joined to the producer op wrote it (`OpNumbering`): no later op to name
            who = "its producer op's own in-place calls wrote it after the copy was made"
        raise InexactRecomputeError(
            f"{what} tensor {tensor!r} at in-place write {actual}, but the step used it at write {expected}: "
            f"{who}, and a recompute replays the producer only (a swap copies it before the write). The "
            "plan cannot run exactly; keep that tensor (slackswap's planners do on a graph captured with "
            "this version)")
