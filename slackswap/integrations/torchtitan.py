"""A plan as torchtitan's activation-checkpoint settings: a TOML file for `--job.config_file`.

torchtitan (pytorch/torchtitan) takes its activation checkpointing from the `[activation_checkpoint]`
table of its job config, `torchtitan/config/job_config.py`, class `ActivationCheckpoint` (read at
commit 000204a4a8bf3d0f31adc44fc29855fbb6ea13d8): `mode` one of "selective", "full", "none", and
`selective_ac_option`, a string: an integer N ("checkpoint every Nth layer": its
`_apply_ac_to_transformer_block` counts the blocks from 1 and wraps block k in full checkpointing when
k % N == 0) or "op" (its own per-op policy, which no plan decides). Those settings decide whole layers
and never offload, so a plan says more than they can: `torchtitan_settings` chooses the layer setting
that recomputes every layer the plan recomputes in (the fewest such layers), and names, one line each,
every decision the settings cannot carry (swaps, kept on the device; a partly recomputed layer,
recomputed whole; a layer recomputed only because the period covers it; a recompute outside every
layer). Made from a `Plan` and its `Graph` alone: no torch, and no torchtitan, which does not install
beside this project's pinned torch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from slackswap.graph import NO_LAYER, Graph
from slackswap.plan import Decision, Plan

#: The `[activation_checkpoint]` keys this file writes and the values torchtitan accepts for `mode`.
MODES = ("selective", "full", "none")


@dataclass(frozen=True)
class TorchtitanSettings:
    """torchtitan's `[activation_checkpoint]` settings for a plan, and what they cannot say."""

    mode: str
    selective_ac_option: str
    #: Layers (0-based) the settings checkpoint (recompute whole in backward).
    checkpointed_layers: tuple[int, ...]
    #: One line per decision of the plan the settings cannot carry.
    not_expressed: tuple[str, ...]

    def toml(self) -> str:
        """The file to pass with `--job.config_file` (merge its table into an existing job config)."""
        lines = [f"# slackswap plan as torchtitan activation checkpointing (checkpointed layers: "
                 f"{list(self.checkpointed_layers)})"]
        lines += [f"# not expressed: {line}" for line in self.not_expressed]
        lines += ["[activation_checkpoint]", f'mode = "{self.mode}"',
                  f'selective_ac_option = "{self.selective_ac_option}"']
        return "\n".join(lines) + "\n"


def torchtitan_settings(plan: Plan, graph: Graph) -> TorchtitanSettings:
    """The torchtitan setting that checkpoints every layer `plan` recomputes in, and as few others as a
    period allows, and the decisions it cannot carry. Its memory is not the plan's (whole layers
    recomputed at once in backward, no swaps): simulate the plan's decisions, not this file."""
    layers = sorted({t.layer for t in graph.tensors.values() if t.layer != NO_LAYER})
    by_layer: dict[int, Counter] = {layer: Counter() for layer in layers}
    outside: Counter = Counter()
    for name, decision in plan.decisions.items():
        layer = graph.tensors[name].layer
        (by_layer[layer] if layer != NO_LAYER else outside)[decision] += 1
    recomputing = [layer for layer in layers if by_layer[layer][Decision.RECOMPUTE]]
    notes = []
    swapped = plan.tensors_with(Decision.SWAP)
    if swapped:
        size = sum(graph.tensors[t].size_bytes for t in swapped)
        notes.append(f"{len(swapped)} swapped tensors ({size} B): torchtitan's activation checkpointing does not "
                     "offload; they stay on the device unless their layer is checkpointed")
    if outside[Decision.RECOMPUTE]:
        notes.append(f"{outside[Decision.RECOMPUTE]} recomputed tensors outside every layer: kept")
    if not recomputing:
        return TorchtitanSettings("none", "2", (), tuple(notes))
    period = math.gcd(*[layer + 1 for layer in recomputing])
    checkpointed = tuple(layer for layer in layers if (layer + 1) % period == 0)
    for layer in recomputing:
        counts = by_layer[layer]
        kept = counts[Decision.KEEP] + counts[Decision.SWAP]
        if kept:
            notes.append(f"layer {layer}: the plan recomputes {counts[Decision.RECOMPUTE]} of its "
                         f"{sum(counts.values())} saved tensors; torchtitan recomputes the whole layer")
    extra = sorted(set(checkpointed) - set(recomputing))
    if extra:
        notes.append(f"layers {extra}: recomputed whole though the plan recomputes nothing there (torchtitan "
                     f"checkpoints every {period}th layer, the largest period covering the plan's)")
    if period == 1:
        return TorchtitanSettings("full", "2", checkpointed, tuple(notes))
    return TorchtitanSettings("selective", str(period), checkpointed, tuple(notes))
