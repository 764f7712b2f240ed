"""Tracing a real model's step (target: an 80-layer Llama-2-70B shape at s=4096 in < 60 s on one core),
and planning and simulating the traced graph.

Run: `python benchmarks/bench_torch_profile.py [--layers 8,80]` (one process, torch on one thread;
pin it to one core with `taskset -c 0` for the figure the target speaks of). For each layer count:
import time of torch + transformers (once), build-and-trace time (`hf_llama2_70b`, sdpa, CUDA
semantics), graph assembly, the keep-all ideal simulation, a slackswap plan at 50 % of the keep-all
peak and its simulation. Writes benchmarks/results/torch_profile.json. One run per figure: tracing 80
layers takes seconds to minutes, so no repeats. Wall seconds and this process's CPU seconds are both
recorded: on a shared machine the wall figure includes waiting for the core, the CPU figure does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slackswap.hardware import load_preset as load_hardware_preset  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.profile.torch.spec import TorchSpec  # noqa: E402

TARGET_TRACE_S = 60.0


def load_preset(name: str) -> tuple[ModelConfig, TorchSpec]:
    data = yaml.safe_load((REPO / f"conf/model/{name}.yaml").read_text())
    base = yaml.safe_load((REPO / f"conf/model/{data['defaults'][0]}.yaml").read_text())
    torch_node = data.pop("torch")
    data.pop("defaults")
    return ModelConfig.from_dict({**base, **data}), TorchSpec.from_dict(torch_node)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="8,80")
    parser.add_argument("--preset", default="hf_llama2_70b")
    args = parser.parse_args()
    t0 = time.perf_counter()
    import torch
    import transformers.masking_utils  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    torch.set_num_threads(1)
    import_s = time.perf_counter() - t0

    from slackswap.planners.registry import get_planner
    from slackswap.profile.torch import trace_model
    from slackswap.profile.torch.assemble import graph_from_trace
    from slackswap.simulate import simulate
    from slackswap.simulate.metrics import simulate_ideal

    hw = load_hardware_preset("a100_80gb_pcie4")
    model0, spec = load_preset(args.preset)
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        model = ModelConfig.from_dict({**model0.__dict__, "num_layers": layers})
        cpu = {}
        c = time.process_time()
        trace, trace_s = trace_model(model, spec)
        cpu["trace"] = time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        graph = graph_from_trace(trace, hw, f"{model.name}@{hw.name}")
        assemble_s, cpu["assemble"] = time.perf_counter() - t, time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        ideal = simulate_ideal(graph, hw)
        ideal_s, cpu["ideal_sim"] = time.perf_counter() - t, time.process_time() - c
        budget = int(0.5 * ideal.peak_activation_bytes)
        t, c = time.perf_counter(), time.process_time()
        plan = get_planner("slackswap").plan(graph, hw, budget)
        plan_s, cpu["plan"] = time.perf_counter() - t, time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        result = simulate(graph, plan, hw, budget)
        sim_s, cpu["simulate"] = time.perf_counter() - t, time.process_time() - c
        row = {"num_layers": layers, "seq_len": model.seq_len, "ops": len(graph.ops), "tensors": len(graph.tensors),
               "saved_tensors": len(graph.saved_tensors), "trace_s": trace_s, "assemble_s": assemble_s,
               "ideal_sim_s": ideal_s, "plan_s": plan_s, "simulate_s": sim_s,
               "keep_all_peak_bytes": int(ideal.peak_activation_bytes), "feasible": bool(result.feasible),
               "throughput_ratio": None if result.step_s is None else ideal.step_s / result.step_s,
               "cpu_s": cpu}
        rows.append(row)
        print(f"{layers:>3} layers: {row['ops']} ops, {row['tensors']} tensors; trace {trace_s:.1f} s, assemble "
              f"{assemble_s:.2f} s, ideal sim {ideal_s:.2f} s, slackswap plan {plan_s:.2f} s, simulate {sim_s:.2f} s "
              f"(50 % budget: feasible={row['feasible']}, throughput {row['throughput_ratio']}); CPU s: "
              + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()), flush=True)
    print(f"imports (torch + transformers llama): {import_s:.1f} s")
    out = {
        "benchmark": "torch_profile", "preset": args.preset, "attention": spec.attention,
        "semantics": spec.semantics, "hardware": hw.name, "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)), "import_s": import_s, "rows": rows,
        "target_trace_80_layers_s": TARGET_TRACE_S,
    }
    r80 = next((r for r in rows if r["num_layers"] == 80), None)
    if r80 is not None:
        out["meets_target"] = r80["trace_s"] < TARGET_TRACE_S
    path = REPO / "benchmarks/results/torch_profile.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
