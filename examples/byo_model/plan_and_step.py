"""The library without the pipeline: capture one step of your model, plan it under a budget, run it.

    PYTHONPATH=examples/byo_model python examples/byo_model/plan_and_step.py

Every name comes from an import below (docs/runtime.md shows the same lines): the hardware from its
preset by name, the budget as a share of the keep-all peak, the planner from the registry.
"""

from __future__ import annotations

import torch
from my_model import build

from slackswap.budget import Budget
from slackswap.hardware import load_preset
from slackswap.model_config import ModelConfig
from slackswap.planners.registry import get_planner
from slackswap.runtime import apply, capture_graph
from slackswap.simulate.metrics import simulate_ideal


def main() -> None:
    config = ModelConfig(name="my_mlp", family="gpt2", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4,
                         ffn_hidden_size=256, seq_len=128, micro_batch_size=2, vocab_size=128)  # fmt: skip
    model, inputs, loss_fn = build(config, "cpu")
    hardware = load_preset("a100_80gb_pcie4")  # conf/hardware/a100_80gb_pcie4.yaml
    graph = capture_graph(model, inputs, loss_fn, hardware, name="my_mlp")  # one real step, recorded
    keep_all_peak_bytes = simulate_ideal(graph, hardware).peak_activation_bytes
    budget_bytes = Budget(fraction=0.5).resolve_bytes(keep_all_peak_bytes)
    plan = get_planner("slackswap").plan(graph, hardware, budget_bytes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer.zero_grad(set_to_none=True)  # apply() wants no .grad before the step
    with apply(plan, graph, model) as run:  # one training step under the plan
        loss = loss_fn(model(*inputs))
        loss.backward()
    optimizer.step()
    report = run.report  # ledger peak, recompute steps, offloads, prefetches, late-prefetch waits
    print(f"my_mlp: {len(graph.ops)} ops; keep-all peak {keep_all_peak_bytes} B, budget {budget_bytes} B; "
          f"loss {loss.item():.4f}; ledger peak {report.ledger_peak_bytes} B; "
          f"{report.offloads} offloads, {report.recompute_steps} recompute steps")  # fmt: skip


if __name__ == "__main__":
    main()
