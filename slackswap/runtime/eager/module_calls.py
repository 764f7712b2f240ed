"""What a recomputing plan's hook-only step must share with the verified step: the order it calls the
model's leaf modules in (`ModuleCalls`), the Python numbers, parameters and buffers its modules hold
(`ModuleState`) and the Python values the model is called with (`forward_arguments`).

Why: a hook-only step checks each saved tensor's shape and dtype against the verified step's record,
and nothing else about the code path. A model whose path changes between steps among modules of one
shape packs the same shapes in the same order, and a recompute would replay the recorded calls, other
modules' ops with their weights, on this step's tensors: a gradient silently wrong. Measured before
this check: a 4-layer stack skipping another layer on each step (LayerDrop: wav2vec2, Whisper and BART's
`layerdrop`), under full_recompute, dtr and memo plans; a layer routing its whole input to one of two
experts of one shape by a Python choice, with its tensors recomputed. One forward pre-hook per leaf
module (a module without children: Linear, LayerNorm, an activation module, ...) sees the first call
that differs, before any recompute runs (4.2-4.7 us a call on this project's machine, a pre-hook
putting the call on PyTorch's slow path, priced by the host-cost model; a 32-layer Llama makes about
350 such calls a step). The eager export, whose checkpoints re-run each layer's own
forward, runs such models exact. A plan that only keeps and moves tensors reads back what each pack
handed over, so its steps are not checked. A path that changes only between functional calls
(`F.gelu` or `F.silu` on one shape, no module) is not seen here: the hook-only step's unpacks check the
autograd node that reads each saved tensor back (`Recording.unpack_nodes`), which sees it in backward.
"""

from __future__ import annotations

import torch
import torch.nn.modules.module as _global_hooks
from torch.utils._pytree import TreeSpec, tree_flatten_with_path

from slackswap.profile.torch.layer_stacks import leaf_modules
from slackswap.runtime.errors import PlanMismatchError
from slackswap.runtime.module_numbers import number_slots

#: Forward-argument values a recorded call can hold that compare by value: what a hook-only step checks.
PLAIN_ARGUMENT_TYPES = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
                        torch.memory_format)


class ModuleCalls:
    """The model's leaf modules and the hooks that record or check the order of their calls."""

    def __init__(self, model: torch.nn.Module) -> None:
        leaves = leaf_modules(model)
        self.paths = [name or "<the model>" for name, _ in leaves]
        self.modules = [m for _, m in leaves]

    def record(self) -> tuple[list[int], list]:
        """Hooks appending each leaf module call's index to the returned list; remove the handles after."""
        calls: list[int] = []
        handles = [m.register_forward_pre_hook(lambda *_, i=i: calls.append(i)) for i, m in enumerate(self.modules)]
        return calls, handles

    def check(self, recorded: tuple[int, ...]) -> list:
        """Hooks raising `PlanMismatchError` at the first leaf module call that is not the recorded one at
        its position; remove the handles after. A step that calls fewer modules packs fewer tensors or
        reads them back in another order, which the hook-only step refuses already."""
        made = [0]

        def hook(i: int) -> None:
            k = made[0]
            if k >= len(recorded) or recorded[k] != i:
                expected = "no module" if k >= len(recorded) else repr(self.paths[recorded[k]])
                raise PlanMismatchError(
                    f"module call {k} of this step is {self.paths[i]!r}; the verified step called {expected} there: "
                    "the code path changed between steps (LayerDrop, a data-dependent branch), and the plan's "
                    "recomputes would replay the recorded modules' calls. Run the plan through the eager export "
                    "(slackswap.runtime.export.PlanExport), whose checkpoints re-run each layer's own forward, or "
                    "train on one code path (layerdrop=0)")
            made[0] = k + 1

        return [m.register_forward_pre_hook(lambda *_, i=i: hook(i)) for i, m in enumerate(self.modules)]


class ModuleState:
    """The Python numbers (int, float, bool) the modules of a model hold as attributes, those of their classes
    (below `torch.nn.Module`), and those of the plain objects they hold (a Hugging Face `PretrainedConfig`,
    and the objects that holds): what a recomputing plan's steps compare with the verified step's before
    running on hooks alone. Why: a recompute replays the verified step's recorded calls with their Python
    numbers, so a number the model reads in forward and the training loop changes between steps (wav2vec2's
    Gumbel temperature, `set_gumbel_temperature`; a scheduled drop probability; `model.config.x`, read in
    forward) would come back as the verified step's: such a step runs verified instead, recording the calls again. The
    attributes are the ones holding a number when the run was made, read by key each step (4 us for a
    2-layer GPT-2's 144, where walking every module's attributes took 63 us); one set later, or a number
    from elsewhere (a global: `eager.global_reads`), is not seen here (docs/runtime.md, "Hook-only steps").

    The same for the modules' parameters and buffers, by object identity: a recorded call holds a
    parameter by reference, so one the training loop replaces with another object (`module.weight =
    nn.Parameter(...)`, `load_state_dict(..., assign=True)`) would be replayed as the old one (before this,
    a step after such a swap had its gradient silently wrong); such a step runs verified too. And the forward
    hooks registered on the modules and on every module (`register_module_forward_hook`), by handle: a hook
    added between steps that changes a module's output (`o * 0.5`) runs ops a recompute would not replay
    (before this, silently wrong); such a step runs verified, recording them."""

    def __init__(self, model: torch.nn.Module) -> None:
        modules = list(model.modules())
        #: (attribute table, key) of each attribute holding a number (what `snapshot` reads first).
        self.number_slots = number_slots(modules)
        self._tensors = tuple((table, key) for m in modules for table in (m._parameters, m._buffers) for key in table)
        self._hooks = (*(table for m in modules for table in (m._forward_pre_hooks, m._forward_hooks)),
                       _global_hooks._global_forward_pre_hooks, _global_hooks._global_forward_hooks)

    def snapshot(self) -> tuple:
        return (tuple([attributes.get(key) for attributes, key in self.number_slots]),
                tuple([id(table.get(key)) for table, key in self._tensors]), tuple(map(tuple, self._hooks)))


def forward_arguments(args: tuple, kwargs: dict) -> tuple[TreeSpec, tuple] | tuple[()]:
    """A model call's arguments as a recomputing plan's hook-only step compares them with the verified
    step's: the tree's structure and each plain value by type and value (a tensor stands as None: the
    forward pre-hook compares its shape and dtype, and a recompute reads it from this step's call).
    Why: a recompute replays the recorded calls with the verified step's Python values, so `model(x,
    temperature=t)` with another `t` would be replayed at the old one (before this, silently wrong).
    `()` for the common call, tensors alone."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return ()
    leaves = tree_flatten_with_path((args, kwargs))
    return (leaves[1], tuple(None if isinstance(x, torch.Tensor) else (type(x), x) for _, x in leaves[0]))


def opaque_argument(args: tuple, kwargs: dict) -> str | None:
    """The first argument of a model call that is neither a tensor nor a plain value (an object whose
    numbers a hook-only step could not compare), as `model(...)` names it; None if there is none."""
    for path, x in tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(x, (torch.Tensor, *PLAIN_ARGUMENT_TYPES)):
            where, inner = path[0].idx, path[2:]
            name = f"positional argument {path[1].idx}" if where == 0 else f"argument {path[1].key!r}"
            return f"{name}{''.join(str(k) for k in inner)} (a {type(x).__name__})"
    return None


__all__ = ["ModuleCalls", "ModuleState", "forward_arguments", "opaque_argument"]
