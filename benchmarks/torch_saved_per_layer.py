"""Per-layer saved bytes of the traced HF presets against the analytic graph, in units of s·b·h bytes.

Run: `python benchmarks/torch_saved_per_layer.py` (needs the torch extra). For hf_bert_large (s=512),
hf_gpt2_xl (s=1024) and hf_llama7b (s=2048, eager and sdpa): the saved bytes of a middle layer of the
traced graph (CUDA semantics) and of the analytic graph of the same shape (eager -> eager, sdpa ->
flash), both divided by s·b·h, and the traced layer's tensors. Prints a table and writes
benchmarks/results/torch_saved_per_layer.json.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_torch_profile import load_preset  # noqa: E402
from slackswap.experiment.baseline import analytic_twin  # noqa: E402
from slackswap.hardware import Hardware  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402
from slackswap.profile.report import layer_profile  # noqa: E402
from slackswap.profile.torch import build_torch_graph  # noqa: E402

CASES = (("hf_bert_large", None), ("hf_gpt2_xl", None), ("hf_llama7b", "eager"), ("hf_llama7b", "sdpa"))


def main() -> None:
    hw = Hardware.from_dict(yaml.safe_load((REPO / "conf/hardware/a100_80gb_pcie4.yaml").read_text()))
    rows = []
    for preset, attention in CASES:
        model, spec = load_preset(preset)
        spec = spec if attention is None else replace(spec, attention=attention)
        t0 = time.perf_counter()
        graph = build_torch_graph(model, spec, hw)
        build_s = time.perf_counter() - t0
        analytic = layer_profile(build_graph(analytic_twin(model, spec), hw))
        traced = layer_profile(graph)
        sbh = model.seq_len * model.micro_batch_size * model.hidden_size
        mid = model.num_layers // 2
        per_layer = sorted({r.saved_bytes for r in traced[:-1]})
        tensors = [(t.name.split(f".{mid}.", 1)[-1] if f".{mid}." in t.name else t.name, t.role,
                    round(t.size_bytes / sbh, 4)) for t in graph.saved_tensors if t.layer == mid]
        row = {"preset": preset, "attention": spec.attention, "seq_len": model.seq_len,
               "micro_batch_size": model.micro_batch_size, "hidden_size": model.hidden_size,
               "traced_layer_bytes": traced[mid].saved_bytes, "analytic_layer_bytes": analytic[mid].saved_bytes,
               "traced_per_sbh": traced[mid].saved_bytes / sbh, "analytic_per_sbh": analytic[mid].saved_bytes / sbh,
               "ratio": traced[mid].saved_bytes / analytic[mid].saved_bytes,
               "distinct_layer_bytes_except_last": per_layer, "trace_and_build_s": build_s,
               "layer_tensors": tensors}
        rows.append(row)
        print(f"{preset:<14} {spec.attention:<6} s={model.seq_len:<5} b={model.micro_batch_size}: traced "
              f"{row['traced_per_sbh']:.3f} sbh/layer, analytic {row['analytic_per_sbh']:.3f} sbh/layer, "
              f"ratio {row['ratio']:.3f} (traced in {build_s:.1f} s)", flush=True)
        for name, role, units in tensors:
            print(f"    {units:>9.4f} sbh  {role:<34} {name}")
    path = REPO / "benchmarks/results/torch_saved_per_layer.json"
    path.write_text(json.dumps({"hardware": hw.name, "semantics": "cuda", "rows": rows}, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
