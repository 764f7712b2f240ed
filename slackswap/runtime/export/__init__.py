"""Export a plan to PyTorch's own machinery: one selective-checkpoint policy per transformer layer.

Why: the eager runtime (`slackswap.runtime.eager`) runs a plan at its own positions but pays Python per ATen
call, and it turns `torch.compile` off. PyTorch already executes such decisions itself:
`torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, context_fn=...)` with a
selective-checkpoint (SAC) policy saves what the policy says (`CheckpointPolicy.MUST_SAVE`) and
recomputes the rest, in eager mode and under `torch.compile` (where the partitioner reads the policy
from each traced node). The export maps keep -> MUST_SAVE, recompute -> MUST_RECOMPUTE, swap ->
MUST_CPU_OFFLOAD, op by op, by the tensor's storage identity (the names plans use).

What PyTorch then decides itself, not the plan (docs/runtime.md, "The export"):
- where recomputation runs: eager, at the first backward unpack of any tensor of the layer, the whole
  layer up to its last needed tensor; compiled, wherever the partitioner puts the recomputed nodes;
- in torch 2.13 MUST_CPU_OFFLOAD is *not* an offload: eager SAC treats it as recompute and the
  partitioner ignores it (only nodes a pass marks `should_offload` are offloaded). The export
  therefore runs swaps itself in eager mode (`_SaveMode`: the copy is made when the op returns, the
  reload at the layer's recompute) and, compiled, turns the plan's swaps into MUST_SAVE plus
  `should_offload` in a joint-graph pass, so `torch._functorch`'s offload pass moves them (offload after
  the tensor's last forward use, reload where backward first needs it);
- compiled, inductor would decompose the ops the plan names and draw its own dropout masks: the
  export's compile keeps those ops whole and ATen's RNG (`slackswap.runtime.export_compile`), so the
  partition saves the plan's tensors, a dropout's mask in its compiled form (bool), which a plan made
  for the compiled export prices (`slackswap.runtime.export_graph`);
- only ops inside a layer are governed: a tensor outside every layer is saved by autograd as usual,
  a layer's input is held by checkpoint for the recompute, a random op's output is always saved (so
  the RNG stream of a recompute stays aligned), an op with several outputs gets one policy. Each such
  case is an `ExportDifference` naming the tensor, what the plan wanted, what PyTorch does, and why.

Eager, the naming, counting, recording and audit run once: the first step after installation (and
any step whose inputs, train, grad or autocast modes differ from the audited one's, or after
`audit_next_step()`, or inside `counting_saved`) asks the policy for every call and records the step;
it leaves per layer call a `CallTable` (each governed ATen call's cache entry: save, offload,
recompute), and the steps after it run from that table by position, naming nothing. A step whose calls
are not the audited ones (another op at a position, one more or fewer) is refused (`CallsDiffer`) and
the next one audited. Why: the audited path cost about twice PyTorch's own selective checkpointing
with a hand-written policy making the same decisions; the table path costs less than it
(docs/runtime.md, "CPU cost per step").

The package, in the order each part stands on the one before: `policy` (the plan's decision per ATen
call as a selective-checkpoint policy), `modes` (eager swaps: save and replay), `install`
(`PlanExport`: the policy installed per layer, eager or compiled) and `audit` (the compiled partition
compared with the plan). It stands on the runtime's base and never on the eager runtime
(`slackswap.runtime.eager`): tests/test_layering.py holds them apart.
"""

from slackswap.runtime.export.audit import (
    DERIVED,
    HELD_OUTPUT,
    MASK_FORM,
    NOT_READ,
    OTHER_BYTES,
    RENAMED,
    UNPLANNED,
    Partitions,
    SavedValue,
    differences_by_reason,
    partition_differences,
    recording_backend,
    saved_bytes,
)
from slackswap.runtime.export.install import PlanExport
from slackswap.runtime.export.modes import CallsDiffer, CallTable, HostCopies
from slackswap.runtime.export.policy import (
    DOES,
    POLICY_OF,
    WANTS,
    ExportDifference,
    SavedCount,
    StepRecord,
    compiled_module_path,
)
from slackswap.runtime.export_compile import InductorBackend, OffloadMarks
from slackswap.runtime.export_facts import (
    IN_PLACE,
    LAYER_OUTPUT,
    NOT_KEPT,
    OUTSIDE,
    RANDOM,
    SEVERAL_OUTPUTS,
    VERSION_READ,
    layer_paths,
)

__all__ = ["CallTable", "CallsDiffer",
    "DERIVED", "DOES", "ExportDifference", "HELD_OUTPUT", "HostCopies", "IN_PLACE", "InductorBackend",
    "LAYER_OUTPUT", "MASK_FORM", "NOT_KEPT", "NOT_READ", "OTHER_BYTES", "OUTSIDE", "OffloadMarks", "POLICY_OF",
    "Partitions", "PlanExport", "RANDOM", "RENAMED", "SEVERAL_OUTPUTS", "SavedCount", "SavedValue", "StepRecord",
    "UNPLANNED", "VERSION_READ", "WANTS", "compiled_module_path", "differences_by_reason", "layer_paths",
    "partition_differences", "recording_backend", "saved_bytes"]
