"""Traced against analytic graphs of one model: FLOPs, bytes and predicted time per op class.

A traced graph (the Hugging Face class on meta tensors, docs/torch_profile.md) and the analytic graph
(docs/profile.md) of the same shape are timed by the same roofline on the same preset. This audit says
where their keep-all step times differ: per op class (matmul, attention, then the elementwise ops by
what they do: norm, softmax, activation, rotary / mask / attention copies, dropout, residual and other,
embedding, loss), per phase, with op counts (each op pays one launch gap), FLOPs, HBM bytes and
seconds. The traced graph is priced twice: `eager` (every aten call its own kernel, as `model(x)`
runs) and `fused` (each run of elementwise ops one kernel, as the analytic graph and the calibrated
presets count them; slackswap.profile.torch.fusion). docs/profile.md, "Traced against analytic",
has the table.

    python benchmarks/traced_vs_analytic.py [--quick]   # needs the torch extra
    -> benchmarks/results/traced_vs_analytic.json

`--quick`: hf_llama7b alone. Step time = the sum of the ops' durations (keep-all, one stream, no
optimizer step), what the simulator's keep-all step is without copies.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, main_with_quick, save_result  # noqa: E402
from slackswap.graph import Graph, OpClass, Phase  # noqa: E402
from slackswap.hardware import load_preset as load_hardware  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402

PRESETS = ("hf_llama7b", "hf_gpt2_xl", "hf_bert_large")
HARDWARE = ("a100_80gb_pcie4", "a100_80gb_sxm_calibrated", "h100_sxm_calibrated")
CLASSES = ("matmul", "attention", "norm", "softmax", "activation", "rotary_mask_copies", "dropout",
           "residual_other", "embedding", "loss")
_ANALYTIC_ROLE = {"rmsnorm": "norm", "layernorm": "norm", "softmax": "softmax", "gelu": "activation",
                  "swiglu": "activation", "rope": "rotary_mask_copies", "dropout": "dropout",
                  "softmax_dropout": "dropout", "residual_add": "residual_other", "embedding": "embedding",
                  "cross_entropy": "loss"}
_DROPOUT_ATEN = ("dropout", "bernoulli")


def traced_class(phase: Phase, op_class: str, aten: str, module: str) -> str:
    """The audit's class of a traced op, from its aten name and the module that ran it."""
    if op_class in (OpClass.MATMUL, OpClass.ATTENTION):
        return str(op_class)
    last = module.rsplit(".", 1)[-1].lower()
    if phase == Phase.LOSS or module.startswith("<loss>"):
        return "loss"
    if "embedding" in aten:
        return "embedding"
    if "softmax" in aten:
        return "softmax"
    if any(d in aten for d in _DROPOUT_ATEN) or "drop" in last:
        return "dropout"
    if "norm" in last or last.startswith("ln"):
        return "norm"
    if any(k in module.lower() for k in ("mlp", "intermediate", "act")):
        return "activation"
    if any(k in module.lower() for k in ("attn", "attention", "rotary")):
        return "rotary_mask_copies"
    return "residual_other"


def analytic_class(op_class: str, role: str) -> str:
    if op_class in (OpClass.MATMUL, OpClass.ATTENTION):
        return str(op_class)
    return _ANALYTIC_ROLE.get(role.removesuffix("_bwd"), "residual_other")


def breakdown(graph: Graph, classify) -> dict:
    """Per class: ops, FLOPs, bytes, seconds (and per phase seconds)."""
    rows: dict[str, dict] = defaultdict(lambda: {"ops": 0, "flops": 0.0, "moved_bytes": 0, "time_s": 0.0,
                                                 "time_s_by_phase": defaultdict(float)})
    for op in graph.ops:
        row = rows[classify(op)]
        row["ops"] += 1
        row["flops"] += op.flops
        row["moved_bytes"] += op.moved_bytes
        row["time_s"] += op.duration_s
        row["time_s_by_phase"][op.phase.value] += op.duration_s
    return {c: {**rows[c], "time_s_by_phase": dict(rows[c]["time_s_by_phase"])} for c in CLASSES if c in rows}


def compare(preset: str) -> dict:
    from benchmarks.bench_torch_profile import load_preset
    from slackswap.profile.torch import trace_model
    from slackswap.profile.torch.assemble import graph_from_trace

    model, spec = load_preset(preset)
    t0 = time.process_time()
    trace, _ = trace_model(model, spec)
    trace_cpu_s = time.process_time() - t0
    by_name = {}
    out: dict = {"model": preset, "attention": spec.attention, "semantics": spec.semantics,
                 "trace_cpu_s": round(trace_cpu_s, 2), "hardware": {}}
    for hw_name in HARDWARE:
        hw = load_hardware(hw_name)
        analytic = build_graph(model, hw)
        a_rows = breakdown(analytic, lambda op: analytic_class(op.op_class, op.role))
        a_step = sum(op.duration_s for op in analytic.ops)
        entry: dict = {"analytic": {"step_s": a_step, "ops": len(analytic.ops), "classes": a_rows}}
        for kernels in ("eager", "fused"):
            traced = graph_from_trace(trace, hw, preset, kernels=kernels, attention_kernel=model.attention_kernel)
            if not by_name:  # graph op i is trace op i (no optimizer ops here)
                by_name.update(zip((op.name for op in traced.ops), trace.ops, strict=True))

            def classify(op):
                t = by_name[op.name]
                return traced_class(t.phase, t.op_class, t.aten, t.module)

            rows = breakdown(traced, classify)
            step = sum(op.duration_s for op in traced.ops)
            ratio = {c: {k: (rows.get(c, {}).get(k, 0) / a_rows[c][k]) if a_rows.get(c, {}).get(k) else None
                         for k in ("flops", "moved_bytes", "time_s")} for c in CLASSES}
            entry[f"traced_{kernels}"] = {"step_s": step, "ops": len(traced.ops), "ratio_to_analytic": step / a_step,
                                          "classes": rows, "class_ratio_to_analytic": ratio}
        out["hardware"][hw_name] = entry
    return out


def run(quick: bool) -> dict:
    try:
        import torch  # noqa: F401
    except ImportError as exc:  # the torch extra is optional
        return save_result("traced_vs_analytic.json", {"skipped": f"torch unavailable: {exc}"})
    presets = PRESETS[:1] if quick else PRESETS
    data = {"machine": machine(), "models": [compare(p) for p in presets]}
    data["machine_end"] = machine()
    print(f"{'model':<14} {'hardware':<26} {'eager/analytic':>14} {'fused/analytic':>14}")
    for m in data["models"]:
        for hw_name, e in m["hardware"].items():
            print(f"{m['model']:<14} {hw_name:<26} {e['traced_eager']['ratio_to_analytic']:>14.3f} "
                  f"{e['traced_fused']['ratio_to_analytic']:>14.3f}")
    save_result("traced_vs_analytic.json", data)
    return data


if __name__ == "__main__":
    main_with_quick(run)
