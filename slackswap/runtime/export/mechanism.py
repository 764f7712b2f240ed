"""Which of PyTorch's mechanisms runs each layer of an eager export: the cheapest one that executes the
plan's decisions for that layer exactly.

Why: selective checkpointing (SAC) routes every ATen call of a layer's forward and of its replay through
a Python dispatch mode (the export's `_SaveMode` / `_TableSaveMode` / `_ReplayMode`, as PyTorch's own SAC
does), a per-call host cost that plain `torch.utils.checkpoint` does not pay: measured on the CPU, one
thread, the 2-layer HF Llama of `benchmarks/measured_profile.py`, the exported full recompute cost about
22 ms a step under SAC against about 19.5 ms with each layer under a plain checkpoint (plain step about
13 ms). A policy is only needed where a layer saves some tensors and recomputes others, so:

- `CHECKPOINT`: every tensor of the layer the plan decides is recomputed (a layer output another layer
  reads is held by that reader whatever the policy, so it does not count), and nothing in the layer
  forces a save under SAC: no random op (SAC saves it so the replay draws the same numbers; a plain
  checkpoint replays it from the stashed RNG state and its outputs are not held), no in-place op (SAC
  saves the chain a write goes into; module state such as BatchNorm's counter would be written twice),
  no op reading a version an in-place op overwrites, no checkpoint candidate held with its op. Then a
  plain non-reentrant checkpoint saves exactly what the SAC wrapper saves (the layer's inputs, its RNG
  state) and its replay runs exactly the ops SAC's would (every op up to the layer's last packed tensor:
  both stop early there);
- `SELECTIVE`: anything else (a kept, swapped or forced tensor beside a recomputed one; a layer with no
  decided tensor), under the export's SAC policy as before.

Decided before any step, from the plan and the graph's facts (`slackswap.runtime.export_facts`), so the
audited step and the steps run from its tables use the same mechanism. A plain-checkpoint layer's record
is written from its decisions (`PlanExport._note_plain`): the policy is never asked there.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from slackswap.graph import FORWARD_PHASES, NO_LAYER, Graph
from slackswap.plan import Decision
from slackswap.runtime.export_facts import LAYER_INPUT, LAYER_OUTPUT, ExportFacts
from slackswap.runtime.op_numbering import overload_of, writes_into
from slackswap.runtime.replay_check import REPLAYABLE_STATE_WRITERS

#: A layer's mechanisms (`layer_mechanisms`).
CHECKPOINT, SELECTIVE = "checkpoint", "selective"


def plain_checkpoint_layers(graph: Graph, decisions: Mapping[str, Decision], forced_layers: Collection[int],
                            layer_outputs: Collection[str]) -> frozenset[int]:
    """The layers the eager export runs under a plain checkpoint (module docstring):
    not in `forced_layers`, with a decided tensor, every decided tensor recomputed but the layer outputs
    another layer holds (`layer_outputs`). Their outputs are in no cache: held by their readers only."""
    outputs = set(layer_outputs)
    decided: dict[int, list[Decision]] = {}
    for name, d in decisions.items():
        t = graph.tensors.get(name)
        if t is not None and t.layer != NO_LAYER and name not in outputs:
            decided.setdefault(t.layer, []).append(d)
    return frozenset(layer for layer, ds in decided.items()
                     if layer not in forced_layers and all(d == Decision.RECOMPUTE for d in ds))


def forced_layers(graph: Graph, facts: ExportFacts) -> frozenset[int]:
    """The layers (the capture's layer index: the export's region) where the SAC policy saves some tensor
    whatever a plan says, or a plain checkpoint would run an op twice that must run once: a tensor fixed
    to keep for another reason than being a layer output, a candidate cached with its op, an op reading an
    overwritten version, a random op, an in-place op."""
    def layer(name: str) -> int:
        t = graph.tensors.get(name)
        return NO_LAYER if t is None else t.layer

    forced = {layer(n) for n, why in facts.fixed_keep.items() if why != LAYER_OUTPUT}
    forced |= {layer(n) for n, why in facts.held_inputs.items() if why != LAYER_INPUT}
    forced |= {layer(n) for n in facts.version_readers}
    for op in graph.ops:
        if op.phase not in FORWARD_PHASES or op.layer == NO_LAYER:
            continue
        func = overload_of(op.name)
        if (func is None or torch.Tag.nondeterministic_seeded in func.tags or writes_into(func)
                or func._overloadpacket.__name__ in REPLAYABLE_STATE_WRITERS):  # a batch norm's statistics
            forced.add(op.layer)
    return frozenset(forced - {NO_LAYER})


def layer_mechanisms(graph: Graph, decisions: Sequence[Mapping[str, Decision]], facts: ExportFacts) -> list[str]:
    """Per region (region i's decisions: `decisions[i]`), `CHECKPOINT` or `SELECTIVE` (module docstring;
    the rule: `plain_checkpoint_layers`, which the price reads too)."""
    outputs = [n for n, why in facts.fixed_keep.items() if why == LAYER_OUTPUT]
    merged = {n: d for region in decisions for n, d in region.items()}
    plain = plain_checkpoint_layers(graph, merged, forced_layers(graph, facts), outputs)
    return [CHECKPOINT if r in plain else SELECTIVE for r in range(len(decisions))]


__all__ = ["CHECKPOINT", "SELECTIVE", "forced_layers", "layer_mechanisms", "plain_checkpoint_layers"]
