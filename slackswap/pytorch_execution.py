"""A plan as PyTorch executes its export, as a plan the simulator runs (plain core code, no torch).

`slackswap.runtime.export` hands a plan's decisions to PyTorch (per-layer checkpoint with a
selective-checkpoint policy). PyTorch then decides the positions itself, differently from the plan:
- eager (`torch.utils.checkpoint`, non-reentrant): the first backward unpack of any tensor of a layer
  re-runs the layer's forward up to its last needed tensor, so every recompute of the layer runs
  there, at once, before that first backward reader; an offloaded tensor is copied back there too
  (no prefetch lead); the offload itself starts when the op returns;
- compiled (inductor; `torch._functorch` activation offloading): recomputed nodes are placed before
  their first backward use (as the plan's scheduler does); an offload runs after the tensor's last
  forward use and the reload right before its first backward use (no prefetch lead, unless
  `activation_reload_prefetch` is on).

`pytorch_plan` rebuilds the plan that way from the decisions PyTorch really executes
(`PlanExport.effective_decisions()`), so `simulate` prices PyTorch's execution beside the plan's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from slackswap.graph import NO_LAYER, Graph, Op, Phase
from slackswap.hardware import Hardware
from slackswap.plan import ComputeStep, Decision, Plan, StepKind, Transfer

MODES = ("eager", "compiled")


def pytorch_plan(graph: Graph, plan: Plan, decisions: Mapping[str, Decision], hardware: Hardware,
                 mode: str = "eager") -> Plan:
    """The plan PyTorch executes for `decisions` (checked by the validator when simulated)."""
    from slackswap.schedule.build import build_schedule

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    base = build_schedule(graph, dict(decisions), planner=f"{plan.planner}@pytorch-{mode}",
                          budget_bytes=plan.budget_bytes, hardware=hardware,
                          notes={**dict(plan.notes), "executed_as": f"pytorch {mode}"})
    ops = graph.op_by_name
    steps = list(base.steps)
    # The first backward step reading a saved tensor of each layer: where PyTorch reloads (and, eager,
    # recomputes) the layer's tensors.
    first_reader: dict[int, int] = {}
    for j, step in enumerate(steps):
        op = ops[step.op]
        if step.kind != StepKind.RUN or op.phase != Phase.BACKWARD:
            continue
        for t in op.inputs:
            tensor = graph.tensors[t]
            if tensor.saved and tensor.layer != NO_LAYER:
                first_reader.setdefault(tensor.layer, j)
    if mode == "eager":
        replay_at = _frame_replays(graph, steps, first_reader, decisions)
        extra = _replayed_transients(graph, steps, replay_at, decisions)
        new_steps, index = _recompute_at_layer_start(graph, steps, replay_at, extra)
    else:
        new_steps, index = steps, list(range(len(steps)))
    # Reloads are placed no later than the first backward reader of any saved tensor of their layer
    # (eager: the replay reloads; this bound is at or before it, conservative where the frame's first
    # unpack comes later; `eager_replay_peak_bytes` allocates them by then, the reloads being blocking).
    block_start = {layer: index[j] for layer, j in first_reader.items()}
    if mode == "eager":  # the layer's recompute block begins before that reader
        for layer in block_start:
            while (block_start[layer] > 0 and new_steps[block_start[layer] - 1].kind == StepKind.RECOMPUTE
                   and graph.tensors[new_steps[block_start[layer] - 1].outputs[0]].layer == layer):
                block_start[layer] -= 1
    offloads = [_offload_at(graph, t, base, index, mode) for t in base.offloads]
    prefetches = []
    for t in base.prefetches:
        layer = graph.tensors[t.tensor].layer
        start = block_start.get(layer)
        issue = index[t.issue_after_step] if t.issue_after_step >= 0 else -1
        if start is not None and mode == "eager":
            # The replay reloads the layer's offloaded tensors all at once (a copy per cached op it
            # meets), not each right before its reader as the plan's schedule does: measured on the zoo's
            # ViT, capuchin at 70 % held ten reloaded copies at once where the price held two.
            issue = min(issue, start - 1)
        elif start is not None:
            issue = max(issue, start - 1)
        if mode == "compiled":
            issue = max(issue, _first_backward_reader(graph, new_steps, t.tensor) - 1)
        prefetches.append(replace(t, issue_after_step=issue))
    prefetches.sort(key=lambda t: t.issue_after_step)
    offloads.sort(key=lambda t: t.issue_after_step)
    return replace(base, steps=tuple(new_steps), offloads=tuple(offloads), prefetches=tuple(prefetches),
                   graph_fingerprint=plan.graph_fingerprint or base.graph_fingerprint)


def _frame_replays(graph: Graph, steps: list[ComputeStep], first_reader: dict[int, int],
                   decisions: Mapping[str, Decision]) -> dict[int, int]:
    """Eager: per layer, the step before which PyTorch replays its forward: the first backward op that
    unpacks a tensor its checkpoint frame packed (`BACKWARD_FRAMES_KEY`, recorded by the capture), or a
    reader of a tensor of the layer that the plan recomputes or offloads, if one comes first. Without the
    capture's record, `first_reader` (the first backward reader of any saved tensor of the layer). The
    record matters where a layer's output is read by the next layer: that op's backward unpacks it from the
    next layer's frame, so the layer's replay does not start there; priced there, the zoo's in-place
    attention stack's full recompute at 70 % was priced 655,368 B, one layer's recomputes early, against
    475,176 B measured (less the RNG state and a weight gradient in flight)."""
    from slackswap.graph import BACKWARD_FRAMES_KEY

    frames = graph.meta.get(BACKWARD_FRAMES_KEY) if graph.meta else None
    if not frames:
        return first_reader
    ops = graph.op_by_name
    moved = {t for t, d in decisions.items() if d != Decision.KEEP}
    at: dict[int, int] = {}
    for j, step in enumerate(steps):
        op = ops[step.op]
        if step.kind != StepKind.RUN or op.phase != Phase.BACKWARD:
            continue
        for layer in frames.get(step.op, ()):
            at.setdefault(layer, j)
        for t in op.inputs:
            tensor = graph.tensors[t]
            if t in moved and tensor.saved and tensor.layer != NO_LAYER:
                at.setdefault(tensor.layer, j)
    return {layer: at.get(layer, j) for layer, j in first_reader.items()}


def replay_stop(graph: Graph, layer_ops: Sequence[Op]) -> int:
    """Index in `layer_ops` (a layer's forward ops, in order) of its last op with a saved output, where an
    eager checkpoint's replay of the layer stops; -1 when none saves anything."""
    return max((i for i, op in enumerate(layer_ops) if any(graph.tensors[t].saved for t in op.outputs)), default=-1)


def makes_no_tensor(graph: Graph, op: Op) -> bool:
    """Every output of `op` is a view of another tensor (view, reshape, transpose, expand, split): a replay
    runs it again, yet no recompute step holds it."""
    return all(graph.tensors[t].base for t in op.outputs)


def _replayed_transients(graph: Graph, steps: list[ComputeStep], first_reader: dict[int, int],
                         decisions: Mapping[str, Decision]) -> dict[int, list[ComputeStep]]:
    """Eager: the recompute replays the layer's forward up to its last op with a saved output, and every op
    on the way that is not cached (no output kept or swapped) runs again, its outputs alive until the
    replay's later ops no longer read them (the attention scores a cached softmax was made from). The
    plan's own recomputes cover the tensors it decided; the others are recompute steps of the layer's
    block (first backward reader's step index -> steps), which `_recompute_at_layer_start` places."""
    have = {t for st in steps if st.kind == StepKind.RECOMPUTE for t in st.outputs}
    cached = {t for t, d in decisions.items() if d in (Decision.KEEP, Decision.SWAP)}
    added: dict[int, list[ComputeStep]] = {}
    for layer, j in first_reader.items():
        ops = [op for op in graph.forward_ops if op.layer == layer]
        for op in ops[:replay_stop(graph, ops) + 1]:
            if makes_no_tensor(graph, op) or cached.intersection(op.outputs) or have.intersection(op.outputs):
                continue
            outs = tuple(t for t in op.outputs if not graph.tensors[t].base)
            added.setdefault(j, []).append(ComputeStep(op.name, StepKind.RECOMPUTE, outs))
    return added


def replayed_views(graph: Graph, layers: Collection[int]) -> dict[int, tuple[str, ...]]:
    """Per layer of `layers`, the forward ops its eager replay runs again that make no tensor of their own
    (views, reshapes, transposes, expands: every output a view of another tensor), up to the layer's
    last op with a saved output, where the replay stops. The executed plan has no recompute step for
    them (`_replayed_transients` adds steps for ops with fresh outputs only), yet the replay re-runs the
    layer's Python forward, so each runs again, with the host work its in-context op time holds (the
    module code that leads to it: 0-45 us a view on hf_gpt2_2l's table, the first of a module the most;
    0.6 ms a step for its two layers' 56)."""
    out: dict[int, tuple[str, ...]] = {}
    for layer in layers:
        ops = [op for op in graph.forward_ops if op.layer == layer]
        views = tuple(op.name for op in ops[:replay_stop(graph, ops) + 1] if makes_no_tensor(graph, op))
        if views:
            out[layer] = views
    return out


def _recompute_at_layer_start(graph: Graph, steps: list[ComputeStep], first_reader: dict[int, int],
                              extra: Mapping[int, list[ComputeStep]] | None = None):
    """Every recompute step of a layer moved right before the layer's first backward reader, with the
    `extra` steps of that reader, in the forward order of their ops (the order the replay runs them).
    Returns the new steps and, per old step, its new index."""
    # A recompute of the layer the plan's schedule placed in the backward pass before that reader (right
    # before a reader of its own, ahead of the replay's start) runs in the replay too: PyTorch recomputes
    # nothing outside it.
    backward = next((j for j, s in enumerate(steps) if graph.op_by_name[s.op].phase == Phase.BACKWARD), len(steps))
    moved: dict[int, list[int]] = {}
    for j, step in enumerate(steps):
        if step.kind == StepKind.RECOMPUTE:
            layer = graph.tensors[step.outputs[0]].layer
            if layer in first_reader and (first_reader[layer] < j or backward < j < first_reader[layer]):
                moved.setdefault(first_reader[layer], []).append(j)
    skip = {j for js in moved.values() for j in js}
    order = graph.op_index
    new_steps: list[ComputeStep] = []
    index = [0] * len(steps)
    for j, step in enumerate(steps):
        block = [(order[steps[m].op], 0, m, steps[m]) for m in moved.get(j, ())]
        block += [(order[x.op], 1, -1, x) for x in (extra or {}).get(j, ())]
        for _, _, m, x in sorted(block, key=lambda e: (e[0], e[1])):
            if m >= 0:
                index[m] = len(new_steps)
            new_steps.append(x)
        if j in skip:
            continue
        index[j] = len(new_steps)
        new_steps.append(step)
    return new_steps, index


def _offload_at(graph: Graph, t: Transfer, base: Plan, index: list[int], mode: str) -> Transfer:
    issue = index[t.issue_after_step] if t.issue_after_step >= 0 else -1
    if mode == "compiled":  # after the tensor's last forward use
        readers = [j for j, s in enumerate(base.steps) if s.kind == StepKind.RUN and t.tensor in
                   graph.op_by_name[s.op].inputs and graph.op_by_name[s.op].phase != Phase.BACKWARD]
        if readers:
            issue = max(issue, index[max(readers)])
    return replace(t, issue_after_step=issue)


def _packing_layers(graph: Graph) -> dict[str, frozenset[int]]:
    """Per tensor, the layers whose checkpoint frame can have packed it: its producer's and each forward
    reader's (an op inside a layer saves its inputs and outputs through that layer's frame)."""
    ops = graph.op_by_name
    out = {}
    for name, t in graph.tensors.items():
        layers = {ops[c].layer for c in t.consumers if ops[c].phase != Phase.BACKWARD}
        layers.add(ops[t.producer].layer)
        out[name] = frozenset(layer for layer in layers if layer != NO_LAYER)
    return out


def eager_replay_peak_bytes(graph: Graph, executed: Plan, hardware: Hardware) -> int:
    """The activation peak of `executed` (`pytorch_plan(..., mode="eager")`) with each recomputed copy held
    as the model's code holds it in the replay. PyTorch's eager replay re-runs the layer's Python forward,
    whose locals keep a tensor until the op after which the forward dropped it (`Tensor.held_until`: HF
    Llama's rotated query and key, alive until `o_proj`), not until its last reader in the replay; where the
    replay stops before that op (early stop, after the layer's last packed tensor) the frames unwind there.
    So a recomputed copy lives at least until the step of its hold in the same recompute block, or to the
    block's end. Measured on the zoo's Llama, recompute_knapsack at 90 %: the query, key and value
    projections' 65,536 B stayed through the attention scores' matmul, which the last-reader rule freed.

    The replay's reloads are blocking copies (`slackswap.runtime.export.HostCopies`): every reloaded copy
    of the layer exists before the backward op whose unpack started the replay runs, so each is allocated
    no later than the end of the step its prefetch is issued after, not when a copy engine the simulator
    keeps busy would start it. Measured on the zoo's ViT, capuchin at 70 % (every tensor of the last
    layer offloaded): the simulator started the last reloads (a hidden state and its LayerNorm's
    statistics, 34,320 B) after the backward's next matmul, the step allocated them before it."""
    from slackswap.schedule.replay import estimate_plan, peak_bytes
    from slackswap.schedule.validate import resolve_schedule

    timeline = estimate_plan(graph, executed, hardware)
    if not graph.has_holds and not executed.prefetches:
        return timeline.peak_bytes
    resolved = resolve_schedule(graph, executed)
    alloc_s = list(timeline.copy_alloc_s)
    for c, source in enumerate(resolved.copy_source):
        if source == "prefetch":
            issue = executed.prefetches[resolved.copy_source_index[c]].issue_after_step
            alloc_s[c] = min(alloc_s[c], timeline.step_end_s[issue] if issue >= 0 else 0.0)
    if not graph.has_holds:
        return peak_bytes(alloc_s, timeline.copy_free_s, timeline.copy_size_bytes)[0]
    steps, index = executed.steps, graph.op_index
    block_end: list[int] = [0] * len(steps)  # per recompute step: the last step of its contiguous block
    j = len(steps) - 1
    while j >= 0:
        if steps[j].kind == StepKind.RECOMPUTE:
            end = j
            while j >= 0 and steps[j].kind == StepKind.RECOMPUTE:
                block_end[j] = end
                j -= 1
        j -= 1
    free_s = list(timeline.copy_free_s)
    for c, tensor in enumerate(resolved.copy_tensor):
        hold = graph.tensors[tensor].held_until
        if not hold or resolved.copy_source[c] != "recompute" or graph.op_by_name[hold].phase == Phase.BACKWARD:
            continue
        made = resolved.copy_source_index[c]
        # The first step of the block at or past the hold's op (the replay has run the hold's op by its
        # end; a view or cached op has no step of its own), else the block's end (the replay stopped).
        at = next((k for k in range(made, block_end[made] + 1) if index[steps[k].op] >= index[hold]),
                  block_end[made])
        free_s[c] = max(free_s[c], timeline.step_end_s[at])
    return peak_bytes(alloc_s, free_s, timeline.copy_size_bytes)[0]


def frame_ends(graph: Graph) -> dict[int, str]:
    """Per layer, the last backward op that can unpack a tensor its eager checkpoint packed: one reading a
    saved tensor its layer made or one of its forward ops read (the checkpoint's frame packs every tensor
    an op inside the layer saves, its inputs from other layers included). The frame, with what it holds
    (the layer's arguments, its selective-checkpoint cache, the RNG state), lives until the last of its
    saved tensors is released; the latest such reader bounds that from above."""
    index = graph.op_index
    forward_layers = _packing_layers(graph)
    ends: dict[int, str] = {}
    for op in graph.ops:
        if op.phase != Phase.BACKWARD:
            continue
        for t in op.inputs:
            if graph.tensors[t].saved:
                for layer in forward_layers[t]:
                    if layer not in ends or index[ends[layer]] < index[op.name]:
                        ends[layer] = op.name
    return ends


#: Graph meta of `eager_frame_holds`' graph: each cached layer output -> its hold before the cache held it
#: (None: its last reader), and the layers where the export's policy saves some tensor whatever a plan says
#: (`slackswap.runtime.export.mechanism.forced_layers`). Read by
#: `slackswap.experiment.export_plan.pytorch_peak_bytes`.
CACHED_OUTPUTS_KEY, FORCED_LAYERS_KEY = "export_cached_outputs", "export_forced_layers"


def eager_frame_holds(graph: Graph, held_inputs: Collection[str], cached_outputs: Collection[str],
                      forced_layers: Collection[int] = ()) -> Graph:
    """`graph` with the holds of PyTorch's eager checkpoint frames: a tensor a layer reads that autograd
    does not save (`held_inputs`: GPT-2's and Llama's attention mask) is one of the layer's arguments,
    which the frame keeps for the recompute until the frame dies; a layer output the export caches
    (`cached_outputs`, saved so the next layer's checkpoint holds it only once) stays in its layer's
    selective-checkpoint cache, which the replay never pops when it stops (early stop) before the output's
    op, until that frame dies too. Each is held until the end of its frames (`frame_ends`), later than its
    last reader; measured, a 2-layer Llama's exported full recompute peaked 65,536 B above a replay that
    freed both at their last readers."""
    from slackswap.graph import LAYER_ARGUMENTS_KEY

    ends = frame_ends(graph)
    if not ends:
        return graph
    index, ops = graph.op_index, graph.op_by_name
    tensors = dict(graph.tensors)
    before = {t: graph.tensors[t].held_until for t in cached_outputs if t in graph.tensors}
    # A layer's arguments, read by its ops or not, stay in its frame (measured: the zoo's Llama's
    # `cache_position`, 512 B passed to every decoder layer and read by none, was freed at the end of the
    # forward in the price and held by the frames into the backward, 528 B above the price with the
    # replay's scalars).
    for name, layers in ((graph.meta or {}).get(LAYER_ARGUMENTS_KEY) or {}).items():
        t = graph.tensors.get(name)
        last = max((ends[layer] for layer in layers if layer in ends), key=index.__getitem__, default=None)
        if t is None or last is None:
            continue
        current = max((index[x] for x in (*t.consumers, *([t.held_until] if t.held_until else ()))),
                      default=index[t.producer])
        if index[last] > current:
            tensors[name] = replace(t, held_until=last)
    for name in {*held_inputs, *cached_outputs}:
        t = tensors.get(name)
        if t is None:
            continue
        layers = {ops[c].layer for c in t.consumers if ops[c].phase != Phase.BACKWARD} if name in held_inputs else set()
        if name in cached_outputs:
            layers.add(ops[t.producer].layer)
        last = max((ends[layer] for layer in layers if layer in ends), key=index.__getitem__, default=None)
        current = max((index[x] for x in (*t.consumers, *([t.held_until] if t.held_until else ()))),
                      default=index[t.producer])
        if last is not None and index[last] > current:
            tensors[name] = replace(t, held_until=last)
    meta = {**dict(graph.meta or {}), CACHED_OUTPUTS_KEY: {t: h for t, h in before.items() if t not in held_inputs},
            FORCED_LAYERS_KEY: sorted(set(forced_layers))}
    return replace(graph, name=f"{graph.name}+frames", tensors=MappingProxyType(tensors), meta=meta)


def uncached_plain_outputs(graph: Graph, plain_layers: Collection[int]) -> Graph:
    """`graph` (`eager_frame_holds`') with the outputs of `plain_layers` (run under a plain checkpoint,
    `slackswap.runtime.export.mechanism`) held as before the cache held them: no cache holds them there
    (measured on the zoo's 2-layer Llama, full recompute: 32,768 B lower than under the SAC policy, one
    layer output)."""
    cached = (graph.meta or {}).get(CACHED_OUTPUTS_KEY)
    plain = set(plain_layers)
    if not cached or not plain:
        return graph
    tensors = dict(graph.tensors)
    for name, hold in cached.items():
        if graph.tensors[name].layer in plain:
            tensors[name] = replace(graph.tensors[name], held_until=hold)
    if tensors == dict(graph.tensors):
        return graph
    return replace(graph, name=f"{graph.name}+plain", tensors=MappingProxyType(tensors))


def eager_cache_holds(graph: Graph, decisions: Mapping[str, Decision]) -> Graph:
    """`graph` with each checkpoint candidate inside a layer that `decisions` keep (a tensor autograd does
    not save: the plan keeps it so a recompute need not run its op again) held as PyTorch's eager
    selective-checkpoint cache holds it. The export caches it (MUST_SAVE) when its op runs, and the cache
    lets go of it only when the layer's replay runs that op again (at the layer's first backward reader)
    or, when the replay stops before that op (early stop, after the layer's last op with a saved output),
    when the frame dies (`frame_ends`). The plan's own schedule frees it at its last reader, in the
    forward when no recompute reads it: measured on the zoo's tied MLP stack, torch_budget at 70 % kept
    three layers' last projections (32,768 B each) in the caches through the loss's backward, 131,072 B
    above that price and over the budget."""
    saved = {t.name for t in graph.saved_tensors}
    kept = [t for t, d in decisions.items() if d == Decision.KEEP and t in graph.tensors and t not in saved
            and graph.tensors[t].layer != NO_LAYER]
    if not kept:
        return graph
    index = graph.op_index
    first: dict[int, str] = {}
    for op in graph.ops:
        if op.phase == Phase.BACKWARD:
            for t in op.inputs:
                tensor = graph.tensors[t]
                if tensor.saved and tensor.layer != NO_LAYER:
                    first.setdefault(tensor.layer, op.name)
    last: dict[int, int] = {}  # per layer, the index of its last forward op with a saved output
    for op in graph.forward_ops:
        if op.layer != NO_LAYER and any(graph.tensors[t].saved for t in op.outputs):
            last[op.layer] = index[op.name]
    ends = frame_ends(graph)
    tensors = dict(graph.tensors)
    for name in kept:
        t = graph.tensors[name]
        layer = t.layer
        until = first.get(layer) if index[t.producer] <= last.get(layer, -1) else ends.get(layer)
        if until is None:
            continue
        current = max((index[x] for x in (*t.consumers, *([t.held_until] if t.held_until else ()))),
                      default=index[t.producer])
        if index[until] > current:
            tensors[name] = replace(t, held_until=until)
    if tensors == dict(graph.tensors):
        return graph
    return replace(graph, name=f"{graph.name}+cache", tensors=MappingProxyType(tensors))


def _first_backward_reader(graph: Graph, steps: list[ComputeStep], tensor: str) -> int:
    """First step of the backward (a backward op or a recompute) that reads `tensor`."""
    for j, s in enumerate(steps):
        op = graph.op_by_name[s.op]
        if (s.kind == StepKind.RECOMPUTE or op.phase == Phase.BACKWARD) and tensor in op.inputs:
            return j
    return len(steps)
