"""A per-rank plan under FSDP2 (slackswap.integrations.distributed, docs/integrations.md).

Two CPU processes with the gloo backend (tests/fsdp2_worker.py) each train an FSDP2 model three SGD
steps plainly and under `PlannedStep` (a swap plan, a knapsack recompute plan, full recompute): every
loss and every local gradient shard equal bit for bit, per rank; the verified step's measured peak
equal to the rank's prediction and within the rank's budget. In this process (a one-rank gloo group):
DDP is refused in one line before the first step runs, and so is the export executor under FSDP2, and
a batch of another shape than the plan's (its capture would run collectives the other ranks do not)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipelines.schemas import REPO_ROOT
from tests.extras import require_torch_extra

torch = require_torch_extra()
dist = torch.distributed
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from slackswap.integrations.planning import IntegrationError  # noqa: E402
from slackswap.integrations.step import PlannedStep  # noqa: E402

CONFIGS = ("slackswap:0.8", "recompute_knapsack:0.85", "full_recompute:1.0")


@pytest.mark.slow
def test_two_fsdp2_ranks_train_bit_exact_under_their_plans(tmp_path) -> None:
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "fsdp2_worker.py"), str(tmp_path), *CONFIGS],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == set(CONFIGS)
        for config, r in results.items():
            assert r["sharded"] == ["DTensor"] and r["graph"].endswith(f".rank{rank}of2"), config
            assert r["same_losses"] == [True] * 3 and r["same_grads"] == [True] * 3, config
            assert r["measured_peak_bytes"] == [r["predicted_peak_bytes"]], config
            assert r["predicted_peak_bytes"] <= r["budget_bytes"] <= r["keep_all_peak_bytes"], config
        assert results["slackswap:0.8"]["decisions"] == ["keep", "swap"]
        assert results["slackswap:0.8"]["budget_bytes"] < results["slackswap:0.8"]["keep_all_peak_bytes"]
        assert "recompute" in results["recompute_knapsack:0.85"]["decisions"]
        assert "recompute" in results["full_recompute:1.0"]["decisions"]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def test_ddp_is_refused_before_the_first_step(one_rank) -> None:
    model = torch.nn.parallel.DistributedDataParallel(_mlp())
    before = [p.detach().clone() for p in model.parameters()]
    state = PlannedStep(0.8, printer=lambda _: None)
    with pytest.raises(IntegrationError, match=r"^model='DistributedDataParallel': DDP's bucketed all-reduce"):
        state.run(model, (torch.randn(4, 8),), lambda out: out.sum())
    assert state.planned is None and state.steps == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_export_under_fsdp2_is_refused_before_the_first_step(one_rank) -> None:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(_mlp())
    state = PlannedStep(0.8, executor="export", printer=lambda _: None)
    with pytest.raises(IntegrationError, match=r"^executor='export': under FSDP2 only the runtime is tested"):
        state.run(model, (torch.randn(4, 8),), lambda out: out.sum())
    assert state.planned is None and all(p.grad is None for p in model.parameters())


def test_another_batch_shape_under_fsdp2_is_refused_before_its_step(one_rank) -> None:
    """A new shape's capture runs the step's collectives: a rank alone at it would hang the others."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(_mlp())
    state = PlannedStep(1.0, printer=lambda _: None)
    state.run(model, (torch.randn(4, 8),), lambda out: out.sum())
    model.zero_grad(set_to_none=True)
    with pytest.raises(IntegrationError, match=r"^inputs=\[\[\[3, 8\], 'torch.float32'\]\]: another batch shape than "
                                               r"this rank's plan \(FSDPSequential@4x8\) under FSDP2: .*a hang"):
        state.run(model, (torch.randn(3, 8),), lambda out: out.sum())
    assert all(p.grad is None for p in model.parameters()) and len(state.plans) == 1
