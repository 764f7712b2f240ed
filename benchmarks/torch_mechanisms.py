"""Saved bytes side by side: torch_sac, full_recompute and torch_budget on the traced graph against
the PyTorch mechanisms they model (SAC, per-layer checkpointing, torch.compile's
activation_memory_budget), run for real on the CPU. docs/planners.md ("Side by side") has the figures.

    python benchmarks/torch_mechanisms.py gpt2 bf16 [inductor]     # or llama; fp32; aot_eager_decomp_partition

HF GPT-2 / Llama with 4 layers, width 256, s = 256, b = 2, vocabulary 512 (the shapes of issue 21).
Each torch.compile takes minutes on 2 shared cores.
"""
import sys
from pathlib import Path

import torch
import yaml

from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision
from slackswap.planners.registry import get_planner
from slackswap.planners.strategies.torch_budget import torch_budget_saved
from slackswap.profile.torch import build_torch_graph
from slackswap.profile.torch.mechanisms import checkpointed_layers, compiled_saved, resident_after_forward
from slackswap.profile.torch.spec import TorchSpec
from slackswap.profile.torch.tracer import ATTENTION_OPS, MATMUL_OPS, find_layers
from slackswap.profile.torch.workloads import build_workload

torch.set_num_threads(1)
HW = Hardware.from_dict(yaml.safe_load((Path(__file__).resolve().parents[1] / "conf/hardware/a100_80gb_pcie4.yaml").read_text()))
fam, dtype = sys.argv[1], sys.argv[2]  # gpt2 | llama, bf16 | fp32
backend = sys.argv[3] if len(sys.argv) > 3 else "inductor"
if fam == "gpt2":
    m = ModelConfig(name="g", family="gpt2", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=1024, seq_len=256, micro_batch_size=2, vocab_size=512, dropout=True, dtype=dtype)
else:
    m = ModelConfig(name="l", family="llama", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=688, seq_len=256, micro_batch_size=2, vocab_size=512, dropout=False, dtype=dtype)
spec = TorchSpec(builder=f"hf_{fam}", attention="eager", semantics="cpu")
g = build_torch_graph(m, spec, HW)
MB = 1e6
def kept_bytes(dec):
    return sum(g.tensors[r].size_bytes for r in {g.storage_root(t) for t, d in dec.items() if d == Decision.KEEP})
torch.manual_seed(0)
net, inputs, loss_fn = build_workload(m, spec, "cpu")
layers = net.get_submodule(find_layers(net)[0])
excl = [*net.parameters(), *inputs]
res, loss = resident_after_forward(lambda: loss_fn(net(*inputs)), excl); loss.backward()
print(f"{fam} {dtype}: eager resident {sum(r.size_bytes for r in res)/MB:.2f} MB, graph saved {sum(g.size_bytes_of[t.name] for t in g.saved_tensors if not t.base)/MB:.2f} MB")
for policy, ops in (("matmuls", MATMUL_OPS | ATTENTION_OPS), ("matmuls_except_attention_core", MATMUL_OPS)):
    with checkpointed_layers(layers, frozenset(ops)):
        res, loss = resident_after_forward(lambda: loss_fn(net(*inputs)), excl); loss.backward()
    p = get_planner("torch_sac", policy=policy).plan(g, HW, None)
    print(f"  SAC {policy}: torch {sum(r.size_bytes for r in res)/MB:.3f} MB, torch_sac {kept_bytes(p.decisions)/MB:.3f} MB")
with checkpointed_layers(layers, None):
    res, loss = resident_after_forward(lambda: loss_fn(net(*inputs)), excl); loss.backward()
p = get_planner("full_recompute").plan(g, HW, None)
print(f"  checkpoint per layer: torch {sum(r.size_bytes for r in res)/MB:.3f} MB, full_recompute {kept_bytes(p.decisions)/MB:.3f} MB")
for b in (1.0, 0.7, 0.5, 0.3):
    saved, loss = compiled_saved(lambda: loss_fn(net(*inputs)), b, backend); loss.backward()
    ours, facts = torch_budget_saved(g, b)
    print(f"  budget {b}: torch.compile({backend}) {sum(v.size_bytes for v in saved)/MB:.3f} MB ({len(saved)} values), "
          f"torch_budget {sum(g.size_bytes_of[t] for t in ours)/MB:.3f} MB ({len(ours)} tensors, {facts['stage']})", flush=True)
