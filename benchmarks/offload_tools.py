"""Offloading every saved tensor against checkpointing, priced as the offloaders people run run it.

Run: `python benchmarks/offload_tools.py` (about a minute on one core). On an 8B-like analytic graph at
seq 8192, micro-batch 1 (llama7b, and llama7b reshaped to Qwen3-8B's published config: 36 layers, 8 KV
heads, FFN 12288, vocabulary 151,936; Qwen/Qwen3-8B config.json), on the calibrated A100 and H100
presets: the step of `full_recompute` (checkpoint every layer), then of offloading every saved tensor
with `trl_offload`'s decisions priced by the ideal offloader (slackswap's runtime: look-ahead, pooled
buffers), and by each tool's offloader (slackswap/schedule/offloader.py), with the cited per-tensor pin
cost (3 ms, pytorch/pytorch PR 186162) and with a warm pinned cache (0). Each as the change against
`full_recompute`.

The measurement it is read against (not fitted to): Qwen3-8B, seq 8192, one GPU, TRL's offloader on
every saved tensor 4,956 ms/step against gradient checkpointing's 2,678 (+85 %),
axolotl-ai-cloud/axolotl PR 3776; the GPU is not stated there. Writes benchmarks/results/offload_tools.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slackswap.hardware import load_preset  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402
from slackswap.schedule.build import build_schedule  # noqa: E402
from slackswap.simulate import simulate  # noqa: E402

PRESETS = ("a100_80gb_sxm_calibrated", "h100_sxm_calibrated")
#: (label, overrides of conf/model/llama7b.yaml)
SHAPES = (
    ("llama7b s8192", {"seq_len": 8192}),
    ("qwen3_8b-like s8192", {"seq_len": 8192, "num_layers": 36, "num_kv_heads": 8, "ffn_hidden_size": 12288,
                             "vocab_size": 151936}),
)
#: (label, planner, options)
RUNS = (
    ("trl_offload (streams), pin 3 ms", "trl_offload", {}),
    ("trl_offload (streams), warm pinned cache", "trl_offload", {"pin_s_per_tensor": 0.0}),
    ("save_on_cpu, pin 3 ms", "save_on_cpu", {}),
    ("save_on_cpu, warm pinned cache", "save_on_cpu", {"pin_s_per_tensor": 0.0}),
    ("hf_checkpoint_offload, pin 3 ms", "hf_checkpoint_offload", {}),
)


def run() -> dict:
    base = yaml.safe_load((ROOT / "conf" / "model" / "llama7b.yaml").read_text())
    rows = []
    for preset in PRESETS:
        hw = load_preset(preset)
        for shape, overrides in SHAPES:
            graph = build_graph(ModelConfig.from_dict(base | overrides), hw)
            ckpt_s = simulate(graph, get_planner("full_recompute").plan(graph, hw, None), hw, None).step_s
            trl = get_planner("trl_offload").plan(graph, hw, None)
            ideal = build_schedule(graph, dict(trl.decisions), planner="ideal", budget_bytes=None, hardware=hw)
            steps = {"every saved tensor, ideal offloader": simulate(graph, ideal, hw, None).step_s}
            for label, planner, options in RUNS:
                steps[label] = simulate(graph, get_planner(planner, **options).plan(graph, hw, None), hw, None).step_s
            print(f"{preset}, {shape}: full_recompute {ckpt_s * 1e3:.0f} ms")
            for label, step_s in steps.items():
                print(f"  {label:42s} {step_s * 1e3:7.0f} ms  {(step_s / ckpt_s - 1) * 100:+6.1f} % vs full_recompute")
            rows.append({"preset": preset, "shape": shape, "full_recompute_s": ckpt_s, "steps_s": steps})
    return {"rows": rows, "measured": {"source": "axolotl-ai-cloud/axolotl PR 3776", "gc_ms": 2677.7,
                                       "trl_all_ms": 4956.2}}


if __name__ == "__main__":
    out = run()
    path = ROOT / "benchmarks" / "results" / "offload_tools.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
