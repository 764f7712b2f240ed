"""Two CPU processes (gloo) asking the Hugging Face Trainer for FSDP2; run by
tests/test_integrations_hf.py as `python tests/hf_fsdp2_worker.py OUT_DIR`.

Each rank builds the example's Trainer (examples/hf_trainer.py) twice and writes OUT_DIR/rank{r}.json:
with `fsdp=True, fsdp_config={"fsdp_version": 2}` on the CPU, Accelerate's distributed type, whether
it runs FSDP2, the one line `plan_for` refuses it with and the wrapper the Trainer trained in without
the plan; with the decoder sharded by `fully_shard` before the Trainer, the error `train()` raises."""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def run() -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard

    from slackswap.integrations.hf import plan_for
    from slackswap.integrations.planning import IntegrationError

    ex = runpy.run_path(str(REPO / "examples" / "hf_trainer.py"))
    found: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as out:
        trainer = ex["make_trainer"]("llama", out, fsdp=True, fsdp_config={"fsdp_version": 2})
        found["distributed_type"] = str(trainer.accelerator.distributed_type).rsplit(".", 1)[-1]
        found["is_fsdp2"] = str(trainer.accelerator.is_fsdp2)
        try:
            plan_for(trainer, 0.5, printer=lambda _: None)
        except IntegrationError as refused:
            found["refused"] = str(refused)
        trainer.train()
        found["trained_in"] = type(trainer.model_wrapped).__name__
    with tempfile.TemporaryDirectory() as out:
        trainer = ex["make_trainer"]("llama", out)
        for layer in trainer.model.model.layers:
            fully_shard(layer)
        fully_shard(trainer.model)
        try:
            trainer.train()
        except RuntimeError as failed:
            found["presharded_error"] = str(failed).splitlines()[0]
    return found


def worker(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(run()))
        # Both ranks finish their collectives before either tears gloo down (a rank aborted with
        # "terminate called without an active exception" at teardown in a loaded run without it).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fork_ranks import EXAMPLE, fork_two_ranks

    fork_two_ranks(worker, (2, sys.argv[1]), (*EXAMPLE, "slackswap.integrations.hf"))
