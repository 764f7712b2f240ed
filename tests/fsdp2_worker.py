"""Two CPU processes (gloo) training an FSDP2 model with and without a per-rank plan; run by
tests/test_integrations_fsdp2.py as `python tests/fsdp2_worker.py OUT_DIR PLANNER:BUDGET ...`.

Each rank builds two identical FSDP2 models (`fully_shard` per block and at the root), trains one
plainly and one under `PlannedStep` for three SGD steps on its own batches, and writes
OUT_DIR/rank{r}.json: per configuration, whether every loss and every local gradient shard was equal
bit for bit, each verified step's measured peak, the prediction, the rank's budget and its keep-all
peak. The planned model's first step is cold: FSDP2's lazy initialisation happens inside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 3


class Net(torch.nn.Module):
    """Three residual MLP blocks in a ModuleList (the capture's layers), width 32, hidden 64."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def sharded() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = Net()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def run(planner: str, budget: float, rank: int) -> dict[str, object]:
    from slackswap.integrations.step import PlannedStep

    batches = [torch.randn(64, 32, generator=torch.Generator().manual_seed(100 * rank + k)) for k in range(STEPS)]
    plain, plain_opt = sharded()
    planned_model, planned_opt = sharded()
    state = PlannedStep(budget, planner, printer=lambda _: None)
    same_losses, same_grads = [], []
    for x in batches:
        loss = _loss(plain(x))
        loss.backward()
        grads = [_local(p.grad) for p in plain.parameters()]
        plain_opt.step()
        plain_opt.zero_grad()
        planned_loss, _ = state.run(planned_model, (x,), _loss)
        same_losses.append(torch.equal(loss.detach(), planned_loss.detach()))
        same_grads.append(all(torch.equal(g, _local(p.grad)) for g, p in
                              zip(grads, planned_model.parameters(), strict=True)))
        planned_opt.step()
        planned_opt.zero_grad()
    p = state.planned
    decisions = sorted({str(d) for d in p.plan.decisions.values()})
    return {"same_losses": same_losses, "same_grads": same_grads, "graph": p.graph.name, "decisions": decisions,
            "measured_peak_bytes": [f["slackswap/measured_peak_bytes"] for f in state.logged],
            "predicted_peak_bytes": p.predicted_peak_bytes, "budget_bytes": p.budget_bytes,
            "keep_all_peak_bytes": p.keep_all_peak_bytes,
            "sharded": [type(q).__name__ for q in planned_model.parameters()][:1]}


def worker(rank: int, world: int, out_dir: str, configs: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    try:
        results = {}
        for config in configs:
            planner, budget = config.split(":")
            results[config] = run(planner, float(budget), rank)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        # Both ranks finish their collectives before either tears gloo down (a rank aborted with
        # "terminate called without an active exception" at teardown in a loaded run without it).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fork_ranks import fork_two_ranks

    out, *wanted = sys.argv[1:]
    fork_two_ranks(worker, (2, out, wanted), ("slackswap.integrations.step",))
