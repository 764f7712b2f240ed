"""Traffic of a traced step when its elementwise chains run as fused kernels (`model.torch.kernels`).

Why: a traced graph has one op per aten call. Eager PyTorch runs each as its own kernel, so HF
Llama's Python RMSNorm (cast to fp32, pow, mean, add, rsqrt, mul, cast back, mul by the weight),
rotary embedding and SiLU * up are 8, 10 and 2 kernels that each read and write a whole activation.
The analytic graph (docs/profile.md) counts one kernel per norm, rotary and SwiGLU, reading its
inputs and writing its outputs once: what fused kernels (Megatron, Apex, Transformer Engine, Liger)
and torch.compile's Inductor run, and the granularity the calibrated presets' HBM efficiency was
fitted at (benchmarks/calibration.py). With `kernels: fused` the traced step is priced at that
granularity, so traced and analytic graphs of one model meet on one calibration; with `eager` (the
default) every aten call is a kernel, as `model(x)` without compilation runs.

The rule (no per-model table): a fused group is a maximal run of elementwise-class ops of one phase
that no GEMM or attention kernel reading the run's results interrupts (`fused_groups`). A storage
that an op of the group creates and that nothing outside the group reads, writes or saves is
internal: it stays in registers, so its write and its reads inside the group cost no HBM traffic.
Inside the group a storage is fetched from HBM once, by its first reader, and one the group made is
read from registers. Every other byte an op moves is kept (parameters, tensors autograd saves,
tensors a later kernel reads). The group is one kernel: one launch gap
(`Hardware.launch_overhead_s`), on its first op.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from slackswap.graph import OpClass
from slackswap.profile.torch.spec import KERNEL_MODES
from slackswap.profile.torch.tracer import Trace

__all__ = ["KERNEL_MODES", "FusedTraffic", "fused_groups", "fused_traffic"]


@dataclass(frozen=True)
class FusedTraffic:
    """Per traced op index: the bytes it moves inside its fused group, and whether it launches the
    group's kernel (False: it runs inside a kernel an earlier op of its group launched)."""

    moved_bytes: dict[int, int]
    launches: dict[int, bool]


def fused_groups(trace: Trace) -> list[list[int]]:
    """Fused groups as traced op indices: runs of elementwise-class ops of one phase. A GEMM or
    attention kernel ends the run only when it reads a storage the run made; one that does not could
    run before the run (HF's SwiGLU: gate GEMM, SiLU, up GEMM, multiply; the up GEMM does not read the
    SiLU, so SiLU and the multiply are one kernel, as in the analytic graph's `swiglu`)."""
    groups: list[list[int]] = []
    current: list[int] = []
    made: set[int] = set()
    phase = None
    for op in trace.ops:
        if op.op_class != OpClass.ELEMENTWISE:
            if made.intersection(op.reads) or made.intersection(op.writes):
                current, made = [], set()
            continue
        if not current or op.phase != phase:
            current, made = [], set()
            groups.append(current)
        current.append(op.index)
        made.update(op.creates)
        phase = op.phase
    return groups


def fused_traffic(trace: Trace) -> FusedTraffic:
    """The bytes each traced op moves when its group runs as one kernel (module docstring).

    Within a group, a storage the group made is read from registers, and a storage from outside is
    fetched once, by its first reader; a made storage is written only when something outside the
    group uses it or autograd saves it. Bytes are storage sizes, so an op that read only part of a
    storage (a slice) can lose more than it counted: each op's figure is floored at 0."""
    touched_by: dict[int, set[int]] = defaultdict(set)  # storage -> ops reading or writing it
    for op in trace.ops:
        for key in (*op.reads, *op.writes):
            touched_by[key].add(op.index)
    by_index = {op.index: op for op in trace.ops}
    moved = {op.index: op.moved_bytes for op in trace.ops}
    launches = dict.fromkeys(moved, True)
    for members in fused_groups(trace):
        inside = set(members)
        made: set[int] = set()
        fetched: set[int] = set()
        for index in members:
            op = by_index[index]
            for key in dict.fromkeys(op.reads):
                if key in made or key in fetched:
                    moved[index] -= trace.storages[key].size_bytes
                fetched.add(key)
            for key in op.creates:
                made.add(key)
                if key not in trace.saved and key not in trace.weight_grads and touched_by.get(key, set()) <= inside:
                    moved[index] -= trace.storages[key].size_bytes
            launches[index] = index == members[0]
    return FusedTraffic({k: max(0, v) for k, v in moved.items()}, launches)
