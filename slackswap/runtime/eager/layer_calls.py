"""The order a step calls the model's layers in: recorded by the verified step, checked by hook-only steps.

Why: a hook-only step checks each saved tensor's shape and dtype against the verified step's record,
and nothing else about the code path. A model that skips a different layer on different steps
(LayerDrop: wav2vec2, Whisper and BART's `layerdrop`, fairseq recipes) packs the same shapes in the
same order when its layers are alike, so a recompute would replay the recorded calls, another layer's
ops with its weights, on this step's tensors: a gradient silently wrong (measured on a 4-layer stack
whose skipped layer moved from one step to the next: full_recompute, dtr and memo plans differed from
plain steps, bit for bit, on every step that skipped another layer). One forward pre-hook per layer of
the model's layer stacks (`slackswap.profile.torch.layer_stacks`) sees it at the first layer that
differs, before any recompute runs; the eager export, whose checkpoints re-run each layer's own
forward, runs such a model exact (measured on the same stack: full_recompute, torch_sac, dtr and
slackswap, five different skips). A plan that only keeps and moves tensors reads back what each pack
handed over, so its steps are not checked. A path that changes only inside a layer (a Python branch
between two parameter-free ops of one shape) is not seen: `apply(..., verify=True)` runs every step
verified, each refused off the captured path.
"""

from __future__ import annotations

import torch

from slackswap.profile.torch.layer_stacks import find_layer_stacks
from slackswap.runtime.errors import PlanMismatchError


class LayerCalls:
    """The model's layers (the layer stacks' children) and the hooks that record or check their calls."""

    def __init__(self, model: torch.nn.Module) -> None:
        stacks = find_layer_stacks(model)
        self.paths = stacks.paths
        self.modules = stacks.modules(model)

    def record(self) -> tuple[list[int], list]:
        """Hooks appending each layer call's index to the returned list; remove the handles after."""
        calls: list[int] = []
        handles = [m.register_forward_pre_hook(lambda *_, i=i: calls.append(i)) for i, m in enumerate(self.modules)]
        return calls, handles

    def check(self, recorded: tuple[int, ...]) -> list:
        """Hooks raising `PlanMismatchError` at the first layer call that is not the recorded one at its
        position; remove the handles after. A step that calls fewer layers packs fewer tensors or reads
        them back in another order, which the hook-only step refuses already."""
        made = [0]

        def hook(i: int) -> None:
            k = made[0]
            if k >= len(recorded) or recorded[k] != i:
                expected = "no layer" if k >= len(recorded) else f"layer {self.paths[recorded[k]]!r}"
                raise PlanMismatchError(
                    f"layer call {k} of this step is {self.paths[i]!r}; the verified step called {expected} there: "
                    "the code path changed between steps (LayerDrop, a data-dependent branch), and the plan's "
                    "recomputes would replay the recorded layer's calls. Run the plan through the eager export "
                    "(slackswap.runtime.export.PlanExport), whose checkpoints re-run each layer's own forward, or "
                    "train with the same layers every step (layerdrop=0)")
            made[0] = k + 1

        return [m.register_forward_pre_hook(lambda *_, i=i: hook(i)) for i, m in enumerate(self.modules)]


__all__ = ["LayerCalls"]
