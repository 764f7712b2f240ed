"""Two CPU processes (gloo) training an FSDP2 Llama-like decoder in an Accelerate loop, with and
without `slackswap.integrations.accelerate.plan_for`; run by tests/test_integrations_accelerate.py as
`python tests/accelerate_fsdp2_worker.py OUT_DIR PRECISION:BUDGET ...` (PRECISION fp32 or bf16).

Accelerate 1.16 on the CPU ignores its FSDP plugin (`FullyShardedDataParallelPlugin(fsdp_version=2)`:
`distributed_type` stays MULTI_CPU and `prepare` wraps the model in DDP), so each rank shards the
example's decoder itself (`fully_shard` per decoder layer and at the root) and passes only the
optimizer to `accelerator.prepare`. Each rank writes OUT_DIR/rank{r}.json: what the plugin did, whether
every loss and every local gradient shard was equal bit for bit over three AdamW steps, the verified
step's measured peak, the prediction, the rank's budget and keep-all peak."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 3
REPO = Path(__file__).resolve().parents[1]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _sharded(accelerator, ex: dict, precision: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The decoder sharded per layer and at the root; "bf16": FSDP2's own mixed precision (bf16
    gathered weights and compute, fp32 gradient reduction and master weights)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if precision == "bf16" else MixedPrecisionPolicy()
    model = ex["tiny_model"]("llama")
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model.train()
    return model, optimizer


def _plugin_outcome(accelerate, plan_for) -> dict[str, str]:
    """What Accelerate does here with its FSDP plugin at version 2 on a plain model, and the one line
    `plan_for` answers for the model `prepare` returned and for an unsharded model."""
    from slackswap.integrations.planning import IntegrationError

    plugin = accelerate.FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = accelerate.Accelerator(cpu=True, fsdp_plugin=plugin)
    prepared = accelerator.prepare(torch.nn.Linear(4, 4))
    outcome = {"distributed_type": str(accelerator.distributed_type).rsplit(".", 1)[-1],
               "is_fsdp2": str(accelerator.is_fsdp2), "prepared": type(prepared).__name__}
    for name, model in (("refused_prepared", prepared), ("refused_unsharded", torch.nn.Linear(4, 4))):
        try:
            plan_for(accelerator, model, printer=lambda _: None)
        except IntegrationError as refused:
            outcome[name] = str(refused)
    return outcome


def run(budget: float, precision: str, rank: int) -> dict[str, object]:
    import accelerate

    from slackswap.integrations.accelerate import plan_for

    ex = runpy.run_path(str(REPO / "examples" / "hf_trainer.py"))
    accelerator = accelerate.Accelerator(cpu=True)
    rows = ex["tiny_dataset"]("llama", 2 * STEPS, seed=rank)
    batches = [{k: torch.stack([r[k] for r in rows[i:i + 2]]) for k in rows[0]} for i in range(0, len(rows), 2)]
    plain, plain_opt = _sharded(accelerator, ex, precision)
    planned, planned_opt = _sharded(accelerator, ex, precision)
    step = plan_for(accelerator, planned, budget, printer=lambda _: None)
    same_losses, same_grads = [], []
    for batch in batches:
        with accelerator.accumulate(plain):
            loss = plain(**batch).loss
            accelerator.backward(loss)
            grads = [_local(p.grad) for p in plain.parameters()]
            plain_opt.step()
            plain_opt.zero_grad()
        with accelerator.accumulate(planned):
            planned_loss = step(batch)
            same_losses.append(torch.equal(loss.detach(), planned_loss))
            same_grads.append(all(torch.equal(g, _local(p.grad))
                                  for g, p in zip(grads, planned.parameters(), strict=True)))
            planned_opt.step()
            planned_opt.zero_grad()
    p = step.planned.planned
    return {"distributed_type": str(accelerator.distributed_type).rsplit(".", 1)[-1],
            "same_losses": same_losses, "same_grads": same_grads, "graph": p.graph.name,
            "decisions": sorted({str(d) for d in p.plan.decisions.values()}),
            "measured_peak_bytes": [f["slackswap/measured_peak_bytes"] for f in step.planned.logged],
            "predicted_peak_bytes": p.predicted_peak_bytes, "budget_bytes": p.budget_bytes,
            "keep_all_peak_bytes": p.keep_all_peak_bytes,
            "sharded": [type(q).__name__ for q in planned.parameters()][:1]}


def worker(rank: int, world: int, out_dir: str, configs: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    try:
        import accelerate

        from slackswap.integrations.accelerate import plan_for

        results: dict[str, object] = {"plugin": _plugin_outcome(accelerate, plan_for)}
        for config in configs:
            precision, budget = config.split(":")
            results[config] = run(float(budget), precision, rank)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        # Both ranks finish their collectives before either tears gloo down (a rank aborted with
        # "terminate called without an active exception" at teardown in a loaded run without it).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fork_ranks import EXAMPLE, fork_two_ranks

    out, *wanted = sys.argv[1:]
    fork_two_ranks(worker, (2, out, wanted), (*EXAMPLE, "slackswap.integrations.accelerate"))
