"""Two CPU processes (gloo) training an FSDP2 Llama-like decoder with Lightning's
`ModelParallelStrategy` (`fully_shard` in `configure_model`), plain and with `SlackSwapCallback`; run by
tests/test_integrations_lightning.py as `python tests/lightning_fsdp2_worker.py OUT_DIR PORT BUDGET`.

Each rank writes OUT_DIR/rank{r}.json: whether every loss and every local gradient shard the optimizer
steps on was equal bit for bit over three AdamW steps, the verified step's measured peak, the
prediction, the rank's budget and keep-all peak, and the one line a DDP strategy, and a model left
unsharded under `ModelParallelStrategy`, are refused with."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch

STEPS = 3
REPO = Path(__file__).resolve().parents[1]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _classes(pl, ex: dict):
    class Decoder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = ex["tiny_model"]("llama")

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if isinstance(self.trainer.strategy, pl.strategies.ModelParallelStrategy):
                mesh = self.device_mesh["data_parallel"]
                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.losses, self.grads = [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(outputs["loss"].detach().clone())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.grads.append([_local(p.grad) for p in pl_module.parameters()])

    return Decoder, Record


def _fit(pl, ex: dict, callback, strategy, shard: bool = True) -> tuple[object, object]:
    Decoder, Record = _classes(pl, ex)
    if not shard:
        Decoder = type("Unsharded", (Decoder,), {"configure_model": lambda self: None})
    pl.seed_everything(0, verbose=False)
    record = Record()
    data = torch.utils.data.DataLoader(ex["tiny_dataset"]("llama", 2 * 2 * STEPS), batch_size=2)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[record] + ([callback] if callback else []))  # fmt: skip
    module = Decoder()
    trainer.fit(module, data)
    return record, module


def run(budget: float) -> dict[str, object]:
    import lightning.pytorch as pl

    from slackswap.integrations.lightning import SlackSwapCallback
    from slackswap.integrations.planning import IntegrationError

    ex = runpy.run_path(str(REPO / "examples" / "hf_trainer.py"))

    def strategy():
        return pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)

    plain, _ = _fit(pl, ex, None, strategy())
    callback = SlackSwapCallback(budget=budget, printer=lambda _: None)
    planned, module = _fit(pl, ex, callback, strategy())
    p = callback.planned.planned
    found = {"same_losses": [torch.equal(a, b) for a, b in zip(plain.losses, planned.losses, strict=True)],
             "same_grads": [all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
                            for a, b in zip(plain.grads, planned.grads, strict=True)],
             "graph": p.graph.name, "decisions": sorted({str(d) for d in p.plan.decisions.values()}),
             "measured_peak_bytes": [f["slackswap/measured_peak_bytes"] for f in callback.planned.logged],
             "predicted_peak_bytes": p.predicted_peak_bytes, "budget_bytes": p.budget_bytes,
             "keep_all_peak_bytes": p.keep_all_peak_bytes, "steps": callback.planned.steps,
             "sharded": [type(q).__name__ for q in module.parameters()][:1],
             "restored": "training_step" not in module.__dict__}
    try:
        _fit(pl, ex, SlackSwapCallback(budget=budget, printer=lambda _: None), "ddp")
    except IntegrationError as refused:
        found["refused_ddp"] = str(refused)
    try:
        _fit(pl, ex, SlackSwapCallback(budget=budget, printer=lambda _: None), strategy(), shard=False)
    except IntegrationError as refused:
        found["refused_unsharded"] = str(refused)
    return found


def worker(rank: int, world: int, out_dir: str, port: str, budget: float) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(run(budget)))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from tests.fork_ranks import EXAMPLE, fork_two_ranks

    out, port, budget = sys.argv[1:]
    fork_two_ranks(worker, (2, out, port, float(budget)),
                   ("lightning.pytorch", *EXAMPLE, "slackswap.integrations.lightning"))
