"""The plan in a hand-written Accelerate loop (slackswap.integrations.accelerate, docs/integrations.md):
three optimizer steps of the example's Llama-like decoder (examples/hf_trainer.py), plain and with
`step = plan_for(accelerator, model, budget=...)`: losses and every gradient equal bit for bit, the
first step's measured peak equal to the predicted one and within the budget."""

from __future__ import annotations

import runpy

import pytest

from pipelines.schemas import REPO_ROOT
from tests.extras import require_torch_extra

torch = require_torch_extra()
require_torch_extra("transformers")
accelerate = require_torch_extra("accelerate")

from slackswap.integrations.accelerate import plan_for  # noqa: E402
from slackswap.integrations.planning import IntegrationError  # noqa: E402

ex = runpy.run_path(str(REPO_ROOT / "examples" / "hf_trainer.py"))


def _loop(planned: dict | None, steps: int = 3, accumulation: int = 1, mixed_precision: str = "no",
          rows: int | None = None):
    """`steps` optimizer steps of the Llama-like decoder on batches of 2 rows; the losses, the
    gradients each step's optimizer gets, and the plan."""
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)  # a precision of its own
    # and an accumulation count of its own: GradientState is a process-wide singleton that an earlier test's
    # Accelerator in the same worker may have set up (this test once saw 6 synced steps of 3 under xdist).
    accelerate.state.GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                                         mixed_precision=mixed_precision)
    model = ex["tiny_model"]("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    rows = ex["tiny_dataset"]("llama", 2 * steps * accumulation if rows is None else rows)
    batches = [{k: torch.stack([r[k] for r in rows[i:i + 2]]) for k in rows[0]} for i in range(0, len(rows), 2)]
    step = plan_for(accelerator, model, printer=lambda _: None, **planned) if planned is not None else None
    losses, grads = [], []
    for batch in batches:
        with accelerator.accumulate(model):
            if step is None:
                loss = model(**batch).loss
                accelerator.backward(loss)
            else:
                loss = step(batch)
            losses.append(loss.detach().clone())
            if accelerator.sync_gradients:
                grads.append([p.grad.detach().clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
    return losses, grads, step


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_an_accelerate_loop_under_the_plan_is_bit_exact_within_budget(accumulation) -> None:
    plain = _loop(None, accumulation=accumulation)
    losses, grads, step = _loop({"budget": 0.5}, accumulation=accumulation)
    assert len(losses) == len(plain[0]) == 3 * accumulation
    assert all(torch.equal(a, b) for a, b in zip(plain[0], losses, strict=True))
    assert len(grads) == len(plain[1]) == 3
    for a, b in zip(plain[1], grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    p = step.planned.planned
    assert len(step.planned.logged) == 1
    assert step.planned.logged[0]["slackswap/measured_peak_bytes"] == p.predicted_peak_bytes <= p.budget_bytes
    assert p.budget_bytes < p.keep_all_peak_bytes


@pytest.mark.slow
def test_a_short_batch_inside_an_accumulation_window_gets_its_plan_bit_exact() -> None:
    """Seven rows in batches of two, two micro-batches a step: the one-row batch is the second window's
    second micro-batch, captured while the first micro-batch's gradients are held (before, the step stopped
    on the first plan's input shapes)."""
    plain = _loop(None, accumulation=2, rows=7)
    losses, grads, step = _loop({"budget": 0.5}, accumulation=2, rows=7)
    assert len(losses) == len(plain[0]) == 4 and len(grads) == len(plain[1]) == 2
    assert all(torch.equal(a, b) for a, b in zip(plain[0], losses, strict=True))
    for a, b in zip(plain[1], grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert [p.graph.meta["input_signature"][0][0][0] for p in step.planned.plans] == [2, 1]


@pytest.mark.slow
def test_bf16_mixed_precision_under_the_plan_is_bit_exact_within_budget() -> None:
    """`mixed_precision="bf16"`: Accelerate wraps the forward in CPU autocast; the plan is captured
    through that wrapper, so its bf16 casts are the step's own."""
    plain = _loop(None, mixed_precision="bf16")
    losses, grads, step = _loop({"budget": 0.5}, mixed_precision="bf16")
    assert step.accelerator.mixed_precision == "bf16" and step.accelerator.scaler is None
    assert all(torch.equal(a, b) for a, b in zip(plain[0], losses, strict=True)) and len(losses) == 3
    for a, b in zip(plain[1], grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    p = step.planned.planned
    fp32 = _loop({"budget": 0.5}, steps=1)[2].planned.planned
    assert p.keep_all_peak_bytes < fp32.keep_all_peak_bytes  # the capture ran the autocast's bf16 activations
    assert step.planned.logged[0]["slackswap/measured_peak_bytes"] == p.predicted_peak_bytes <= p.budget_bytes
    assert p.budget_bytes < p.keep_all_peak_bytes


def test_a_batch_of_another_kind_is_one_line() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    step = plan_for(accelerator, ex["tiny_model"]("llama"))
    with pytest.raises(IntegrationError, match=r"^batch='str': must be a mapping"):
        step("tokens")


@pytest.mark.slow
def test_two_fsdp2_ranks_in_an_accelerate_loop_train_bit_exact_under_their_plans(tmp_path) -> None:
    """Two CPU processes (gloo, tests/accelerate_fsdp2_worker.py): the decoder sharded with
    `fully_shard`, three AdamW steps in an Accelerate loop plain and under `plan_for`, in fp32 at half
    each rank's keep-all peak and under FSDP2's bf16 mixed precision at 0.7 (at 0.5 its LM head's
    logits leave no plan); the plugin's CPU outcome (DDP) and its one-line refusal recorded."""
    import json
    import subprocess
    import sys

    configs = ("fp32:0.5", "bf16:0.7")
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "accelerate_fsdp2_worker.py"), str(tmp_path),
                           *configs], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        plugin = results.pop("plugin")
        assert (plugin["distributed_type"], plugin["is_fsdp2"], plugin["prepared"]) == (
            "MULTI_CPU", "False", "DistributedDataParallel")
        assert plugin["refused_prepared"].startswith("model='DistributedDataParallel': DDP's bucketed")
        assert plugin["refused_unsharded"].startswith(
            "accelerator.distributed_type='MULTI_CPU': several processes run a plan only on an FSDP2 model")
        assert set(results) == set(configs)
        for config, r in results.items():
            assert r["distributed_type"] == "MULTI_CPU", config
            assert r["sharded"] == ["DTensor"] and r["graph"].endswith(f".rank{rank}of2"), config
            assert r["same_losses"] == [True] * 3 and r["same_grads"] == [True] * 3, config
            assert r["measured_peak_bytes"] == [r["predicted_peak_bytes"]], config
            assert r["predicted_peak_bytes"] <= r["budget_bytes"] < r["keep_all_peak_bytes"], config
            assert "swap" in r["decisions"] or "recompute" in r["decisions"], config
        # FSDP2's bf16 gathers and computes in bf16: the activations it keeps are smaller
        assert results["bf16:0.7"]["keep_all_peak_bytes"] < results["fp32:0.5"]["keep_all_peak_bytes"]
