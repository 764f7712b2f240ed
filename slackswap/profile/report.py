"""Per-layer views of a profiled graph: `profile.csv` rows and the human-readable breakdown.

`saved_bytes` of a layer is the bytes of the saved activations attributed to it (`Tensor.layer`: the
layer whose backward reads them), so for BERT/GPT-2 with 16-bit activations, dropout and eager
attention it equals Korthikanti's s*b*h*(34 + 5*a*s/h). FLOPs are matrix-multiply FLOPs only.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from slackswap.graph import FORWARD_PHASES, NO_LAYER, Graph, Phase

LAYER_COLUMNS: tuple[str, ...] = ("layer", "saved_bytes", "fwd_flops", "bwd_flops", "fwd_s", "bwd_s")
#: profile.csv: the layer's row, then the analytic (formula) graph's saved bytes of that layer and
#: saved_bytes / formula_saved_bytes (1.0 for an analytic graph, which is its own reference).
CSV_COLUMNS: tuple[str, ...] = (*LAYER_COLUMNS, "formula_saved_bytes", "saved_ratio")


@dataclass(frozen=True)
class LayerProfile:
    layer: int
    saved_bytes: int
    fwd_flops: float
    bwd_flops: float
    fwd_s: float
    bwd_s: float


assert tuple(f.name for f in fields(LayerProfile)) == LAYER_COLUMNS


def _sums(graph: Graph) -> tuple[dict, dict, dict, dict, dict]:
    saved: dict[int, int] = defaultdict(int)
    fwd_flops: dict[int, float] = defaultdict(float)
    bwd_flops: dict[int, float] = defaultdict(float)
    fwd_s: dict[int, float] = defaultdict(float)
    bwd_s: dict[int, float] = defaultdict(float)
    for t in graph.saved_tensors:
        saved[t.layer] += t.size_bytes
    for op in graph.ops:
        if op.phase == Phase.FORWARD:
            fwd_flops[op.layer] += op.flops
            fwd_s[op.layer] += op.duration_s
        elif op.phase == Phase.BACKWARD:
            bwd_flops[op.layer] += op.flops
            bwd_s[op.layer] += op.duration_s
    return saved, fwd_flops, bwd_flops, fwd_s, bwd_s


def layer_profile(graph: Graph) -> tuple[LayerProfile, ...]:
    """One row per transformer layer 0..num_layers-1 (embeddings, head and loss are not a layer)."""
    saved, ff, bf, fs, bs = _sums(graph)
    return tuple(
        LayerProfile(layer, saved[layer], ff[layer], bf[layer], fs[layer], bs[layer])
        for layer in range(graph.num_layers)
    )


def write_profile_csv(graph: Graph, path: str | Path, reference: Graph | None = None) -> Path:
    """Write `profile.csv` (columns exactly CSV_COLUMNS); floats in repr form so they read back exactly.

    `reference`: the analytic graph of the same shape when `graph` was traced from a real model
    (None: `graph` is analytic and its own reference). Its layer count must match.
    """
    path = Path(path)
    reference = graph if reference is None else reference
    formula = {row.layer: row.saved_bytes for row in layer_profile(reference)}
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for row in layer_profile(graph):
            ref = formula[row.layer]
            ratio = row.saved_bytes / ref if ref else float("nan")
            values = (*astuple(row), ref, ratio)
            writer.writerow([repr(v) if isinstance(v, float) else v for v in values])
    return path


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def _held_lines(graph: Graph, top: int = 12) -> list[str]:
    """The model's own hold (`Tensor.held_until`): tensors its code keeps alive past their last reader
    of their own phase. A fact of the workload: no plan frees them earlier (docs/runtime.md)."""
    held = [t for t in graph.tensors.values() if t.held_until]
    if not held:
        return []
    owned = sum(graph.owned_bytes(t.name) for t in held)
    lines = ["", f"held by the model's own code past their last reader: {len(held)} tensors, "
                 f"{_mib(owned)} MiB of storage (largest {min(top, len(held))}):",
             f"  {'tensor':<48} {'bytes':>12}  held until"]
    for t in sorted(held, key=lambda t: (-t.size_bytes, t.name))[:top]:
        lines.append(f"  {t.name:<48} {t.size_bytes:>12d}  {t.held_until}")
    return lines


def format_breakdown(graph: Graph) -> str:
    """Per-layer table (saved bytes, FLOPs, times), then the saved tensors and forward ops of layer 0 and of
    the non-layer part (embeddings, head, loss), for a user inspecting a model without planning."""
    saved, ff, bf, fs, bs = _sums(graph)
    lines = [f"graph {graph.name}: {len(graph.ops)} ops, {len(graph.tensors)} tensors, "
             f"{len(graph.saved_tensors)} saved"]
    lines.append(f"weights {_gib(graph.weight_bytes)} GiB, weight grads {_gib(graph.weight_grad_bytes)} GiB, "
                 f"optimizer state {_gib(graph.optimizer_state_bytes)} GiB (not counted against the budget)")
    lines.append("")
    lines.append(f"{'layer':>6} {'saved_bytes':>14} {'saved_MiB':>11} {'fwd_GFLOP':>12} {'bwd_GFLOP':>12} "
                 f"{'fwd_ms':>9} {'bwd_ms':>9}")
    for layer in [*range(graph.num_layers), NO_LAYER]:
        label = str(layer) if layer != NO_LAYER else "other"
        lines.append(f"{label:>6} {saved[layer]:>14d} {_mib(saved[layer]):>11} {ff[layer] / 1e9:>12.3f} "
                     f"{bf[layer] / 1e9:>12.3f} {fs[layer] * 1e3:>9.3f} {bs[layer] * 1e3:>9.3f}")
    lines.append(f"{'total':>6} {sum(saved.values()):>14d} {_mib(sum(saved.values())):>11} "
                 f"{sum(ff.values()) / 1e9:>12.3f} {sum(bf.values()) / 1e9:>12.3f} "
                 f"{sum(fs.values()) * 1e3:>9.3f} {sum(bs.values()) * 1e3:>9.3f}")
    step_s = sum(op.duration_s for op in graph.ops)
    lines.append(f"step (sum of op durations, all phases): {step_s * 1e3:.3f} ms")
    for layer, title in ((0, "layer 0"), (NO_LAYER, "outside the stack")):
        if layer == 0 and graph.num_layers == 0:
            continue
        lines.append("")
        lines.append(f"saved tensors, {title}:")
        lines.append(f"  {'tensor':<28} {'role':<20} {'bytes':>14}")
        for t in graph.saved_tensors:
            if t.layer == layer:
                lines.append(f"  {t.name:<28} {t.role:<20} {t.size_bytes:>14d}")
        lines.append(f"forward ops, {title}:")
        lines.append(f"  {'op':<28} {'class':<12} {'GFLOP':>10} {'moved_MiB':>10} {'us':>10}")
        for op in graph.ops:
            if op.layer == layer and op.phase in FORWARD_PHASES:
                lines.append(f"  {op.name:<28} {op.op_class.value:<12} {op.flops / 1e9:>10.3f} "
                             f"{op.moved_bytes / 2**20:>10.2f} {op.duration_s * 1e6:>10.1f}")
    lines.extend(_held_lines(graph))
    if graph.num_layers > 1:
        same = all(saved[layer] == saved[0] for layer in range(graph.num_layers))
        lines.append("")
        lines.append("layers 1.. have the same tensors and ops as layer 0" if same else
                     "layers differ in saved bytes: see the table above")
    return "\n".join(lines)
