"""The plan in Lightning (slackswap.integrations.lightning, docs/integrations.md): three optimizer steps
of the example's Llama-like decoder (examples/hf_trainer.py) in a LightningModule, plain and with the
callback: losses and every gradient equal bit for bit, the first step's measured peak equal to the
predicted one and within the budget."""

from __future__ import annotations

import runpy

import pytest

from pipelines.schemas import REPO_ROOT
from tests.extras import require_torch_extra

torch = require_torch_extra()
require_torch_extra("transformers")
pl = require_torch_extra("lightning.pytorch")

from slackswap.integrations.lightning import SlackSwapCallback  # noqa: E402
from slackswap.integrations.planning import IntegrationError  # noqa: E402

ex = runpy.run_path(str(REPO_ROOT / "examples" / "hf_trainer.py"))


class Decoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = ex["tiny_model"]("llama")

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
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])


def _fit(callback, steps: int = 3, accumulation: int = 1, rows: int | None = None, **trainer_args):
    pl.seed_everything(0, verbose=False)
    record = Record()
    rows = 2 * steps * accumulation if rows is None else rows
    data = torch.utils.data.DataLoader(ex["tiny_dataset"]("llama", rows), batch_size=2)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulation,
                         callbacks=[record] + ([callback] if callback else []), **trainer_args)  # fmt: skip
    module = Decoder()
    trainer.fit(module, data)
    return record, module


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_lightning_steps_under_the_plan_are_bit_exact_within_budget(accumulation) -> None:
    plain, _ = _fit(None, accumulation=accumulation)
    callback = SlackSwapCallback(budget=0.5, printer=lambda _: None)
    planned, module = _fit(callback, accumulation=accumulation)
    assert len(plain.losses) == len(planned.losses) == 3 * accumulation
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, planned.losses, strict=True))
    assert len(plain.grads) == len(planned.grads) == 3
    for a, b in zip(plain.grads, planned.grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    p = callback.planned.planned
    assert callback.planned.steps == 3 * accumulation and len(callback.planned.logged) == 1
    assert callback.planned.logged[0]["slackswap/measured_peak_bytes"] == p.predicted_peak_bytes <= p.budget_bytes
    assert p.budget_bytes < p.keep_all_peak_bytes
    assert "training_step" not in module.__dict__  # the class's own again after the fit


@pytest.mark.slow
def test_a_short_last_batch_gets_its_own_plan_bit_exact() -> None:
    """Five rows in batches of two: the epoch's third batch has one row, a shape of its own, planned at it
    (before, the step stopped on the first plan's input shapes)."""
    plain, _ = _fit(None, steps=4, rows=5)
    callback = SlackSwapCallback(budget=0.5, printer=lambda _: None)
    planned, _ = _fit(callback, steps=4, rows=5)
    assert len(plain.grads) == len(planned.grads) == 4
    for a, b in zip(plain.grads, planned.grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    plans = callback.planned.plans
    assert [p.graph.meta["input_signature"][0][0][0] for p in plans] == [2, 1]
    assert len(callback.planned.logged) == 2  # each shape's first step verified


@pytest.mark.slow
def test_manual_optimization_is_refused_before_the_first_step() -> None:
    class Manual(Decoder):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[SlackSwapCallback(printer=lambda _: None)])  # fmt: skip
    data = torch.utils.data.DataLoader(ex["tiny_dataset"]("llama", 2), batch_size=2)
    with pytest.raises(IntegrationError, match=r"^LightningModule.automatic_optimization=False"):
        trainer.fit(Manual(), data)
    assert trainer.global_step == 0


@pytest.mark.slow
def test_two_fsdp2_ranks_under_model_parallel_strategy_train_bit_exact(tmp_path) -> None:
    """Two CPU processes (gloo, tests/lightning_fsdp2_worker.py): `ModelParallelStrategy` with
    `fully_shard` in `configure_model`, three AdamW steps plain and with the callback at half each
    rank's keep-all peak; the DDP strategy and an unsharded model refused in one line before the first step."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a free port for the strategy's TCP rendezvous
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "lightning_fsdp2_worker.py"), str(tmp_path),
                           port, "0.5"], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["sharded"] == ["DTensor"] and r["graph"].endswith(f".rank{rank}of2") and r["restored"]
        assert r["same_losses"] == [True] * 3 and r["same_grads"] == [True] * 3 and r["steps"] == 3
        assert r["measured_peak_bytes"] == [r["predicted_peak_bytes"]]
        assert r["predicted_peak_bytes"] <= r["budget_bytes"] < r["keep_all_peak_bytes"]
        assert "swap" in r["decisions"] or "recompute" in r["decisions"]
        assert r["refused_ddp"].startswith("model='DistributedDataParallel': DDP's bucketed all-reduce")
        assert r["refused_unsharded"] == ("Trainer.world_size=2: several processes run a plan only on an FSDP2 model: "
                                          "ModelParallelStrategy with fully_shard in configure_model")
