"""Saved bytes side by side: torch_sac, full_recompute and torch_budget on the traced graph against
the PyTorch mechanisms they model (SAC, per-layer checkpointing, torch.compile's
activation_memory_budget), run for real on the CPU. docs/planners.md ("Side by side") has the figures.

    python benchmarks/torch_mechanisms.py gpt2 bf16 [inductor]   # or llama; fp32; aot_eager_decomp_partition

HF GPT-2 / Llama with 4 layers, width 256, s = 256, b = 2, vocabulary 512 (the shapes of issue 21).
Each torch.compile takes minutes on 2 shared cores.
"""

from __future__ import annotations

import sys

import torch

from slackswap.hardware import load_preset
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision
from slackswap.planners.registry import get_planner
from slackswap.planners.strategies.torch_budget import torch_budget_saved
from slackswap.profile.torch import build_torch_graph
from slackswap.profile.torch.layer_stacks import find_layer_stacks
from slackswap.profile.torch.mechanisms import checkpointed_layers, compiled_saved, resident_after_forward
from slackswap.profile.torch.spec import TorchSpec
from slackswap.profile.torch.tracer import ATTENTION_OPS, MATMUL_OPS
from slackswap.profile.torch.workloads import build_workload

MB = 1e6


def model_for(family: str, dtype: str) -> ModelConfig:
    ffn, dropout = (1024, True) if family == "gpt2" else (688, False)
    return ModelConfig(name=f"{family}_4l", family=family, num_layers=4, hidden_size=256, num_heads=4,
                       num_kv_heads=4, ffn_hidden_size=ffn, seq_len=256, micro_batch_size=2, vocab_size=512,
                       dropout=dropout, dtype=dtype)


def main(family: str, dtype: str, backend: str) -> None:
    torch.set_num_threads(1)
    hw = load_preset("a100_80gb_pcie4")
    model = model_for(family, dtype)
    spec = TorchSpec(builder=f"hf_{family}", attention="eager", semantics="cpu")
    graph = build_torch_graph(model, spec, hw)

    def kept_mb(planner: str, **options: object) -> float:
        plan = get_planner(planner, **options).plan(graph, hw, None)
        roots = {graph.storage_root(t) for t, d in plan.decisions.items() if d == Decision.KEEP}
        return sum(graph.tensors[r].size_bytes for r in roots) / MB

    torch.manual_seed(0)
    net, inputs, loss_fn = build_workload(model, spec, "cpu")
    layers = find_layer_stacks(net).modules(net)
    exclude = [*net.parameters(), *inputs]

    def resident_mb() -> float:
        resident, loss = resident_after_forward(lambda: loss_fn(net(*inputs)), exclude)
        loss.backward()
        return sum(r.size_bytes for r in resident) / MB

    saved_mb = sum(graph.size_bytes_of[t.name] for t in graph.saved_tensors if not t.base) / MB
    print(f"{family} {dtype}: eager step keeps {resident_mb():.3f} MB; the traced graph saves {saved_mb:.3f} MB")
    for policy, ops in (("matmuls", MATMUL_OPS | ATTENTION_OPS), ("matmuls_except_attention_core", MATMUL_OPS)):
        with checkpointed_layers(layers, frozenset(ops)):
            real = resident_mb()
        print(f"  SAC {policy}: torch {real:.3f} MB, torch_sac {kept_mb('torch_sac', policy=policy):.3f} MB")
    with checkpointed_layers(layers, None):
        real = resident_mb()
    print(f"  checkpoint per layer: torch {real:.3f} MB, full_recompute {kept_mb('full_recompute'):.3f} MB")
    for fraction in (1.0, 0.7, 0.5, 0.3):
        saved, loss = compiled_saved(lambda: loss_fn(net(*inputs)), fraction, backend)
        loss.backward()
        ours, facts = torch_budget_saved(graph, fraction)
        ours_mb = sum(graph.size_bytes_of[t] for t in ours) / MB
        print(f"  budget {fraction}: torch.compile({backend}) {sum(v.size_bytes for v in saved) / MB:.3f} MB "
              f"({len(saved)} values), torch_budget {ours_mb:.3f} MB ({len(ours)} tensors, {facts['stage']})",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "inductor")
