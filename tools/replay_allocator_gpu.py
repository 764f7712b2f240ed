"""Replay one plan's allocation sequence with torch.cuda and compare memory_reserved with the model.

    python tools/replay_allocator_gpu.py --run-dir outputs/<date>/<time>       # a finished run
    python tools/replay_allocator_gpu.py model=gpt2_xl planner=slackswap        # or plan one now
    python tools/replay_allocator_gpu.py --dry-run model=tiny                    # model side only, no GPU

The plan is simulated again (deterministic), its allocations and frees are derived exactly as the
`simulate.allocator=caching` report does (`slackswap.memory.allocator_replay.memory_ops`), and then
- the model: every call goes through `slackswap.memory.caching_allocator.CachingAllocator`;
- the GPU: every allocation is `torch.empty(size, dtype=torch.uint8, device="cuda")`, every free drops
  that tensor, on the default stream, after `torch.cuda.empty_cache()`;
and `memory_reserved` / `memory_allocated` are compared after every call. The figures go to stdout and,
with `--out`, to a JSON file. Exit status 1 when the GPU and the model disagree at any call.

Needs the default allocator settings (`PYTORCH_CUDA_ALLOC_CONF` unset): `expandable_segments`,
`max_split_size_mb` or `roundup_power2_divisions` change the rules the model follows. Without a CUDA
device, only `--dry-run` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from slackswap.memory.allocator_replay import MemoryOp, memory_ops  # noqa: E402
from slackswap.memory.caching_allocator import CachingAllocator  # noqa: E402


def model_trajectory(ops: list[MemoryOp]) -> list[tuple[int, int]]:
    """(reserved, allocated) of the allocator model after every call."""
    allocator = CachingAllocator()
    blocks, out = {}, []
    for op in ops:
        if op.alloc:
            blocks[op.copy] = allocator.malloc(op.size_bytes)
        else:
            allocator.free(blocks.pop(op.copy))
        out.append((allocator.reserved_bytes, allocator.allocated_bytes))
    return out


def gpu_trajectory(ops: list[MemoryOp]) -> list[tuple[int, int]]:
    """(memory_reserved, memory_allocated) of torch.cuda after every call."""
    import torch

    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() or torch.cuda.memory_reserved():
        raise SystemExit("the CUDA caching allocator is not empty before the replay; run in a fresh process")
    live, out = {}, []
    for op in ops:
        if op.alloc:
            live[op.copy] = torch.empty(op.size_bytes, dtype=torch.uint8, device="cuda")
        else:
            del live[op.copy]
        out.append((torch.cuda.memory_reserved(), torch.cuda.memory_allocated()))
    live.clear()
    return out


def _plan_from_run_dir(run_dir: Path):
    import yaml

    from slackswap.graph_io import read_graph_json
    from slackswap.hardware import Hardware
    from slackswap.plan_io import read_plan_json

    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    graph = read_graph_json(run_dir / "graph.json")
    plan = read_plan_json(run_dir / "plan.json")
    return graph, plan, Hardware.from_dict(resolved["hardware"]), metrics["budget_bytes"]


def _plan_from_overrides(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipelines.hydra_versions import MAIN_VERSION
    from slackswap.experiment import RunSpec, run_one

    with initialize_config_dir(config_dir=str(REPO / "conf"), **MAIN_VERSION):
        cfg = compose("config", overrides=[*overrides, "tracking=off"])
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    spec = RunSpec.from_dict(resolved)
    outcome = run_one(spec)
    if outcome.plan is None:
        raise SystemExit(f"no plan to replay: {outcome.reason}")
    return outcome.graph, outcome.plan, spec.hardware, outcome.budget_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, help="a finished run directory (graph.json, plan.json, ...)")
    parser.add_argument("--dry-run", action="store_true", help="model side only; no torch.cuda")
    parser.add_argument("--out", type=Path, help="write the comparison as JSON here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides when no --run-dir is given")
    args = parser.parse_args(argv)
    torch = None
    if not args.dry_run:  # fail before any planning when the GPU side cannot run
        try:
            import torch
        except ImportError:
            print("torch is not installed: only --dry-run can run here", file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print("no CUDA device: only --dry-run can run here", file=sys.stderr)
            return 2
        if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
            print("PYTORCH_CUDA_ALLOC_CONF is set; the model follows the default allocator", file=sys.stderr)
            return 2

    from slackswap.errors import ConfigError, FileFormatError
    from slackswap.simulate import simulate

    try:
        graph, plan, hardware, budget = (
            _plan_from_run_dir(args.run_dir) if args.run_dir else _plan_from_overrides(args.overrides)
        )
    except (FileFormatError, ConfigError, FileNotFoundError) as exc:  # a truncated graph.json, a missing file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = simulate(graph, plan, hardware, budget)
    ops = memory_ops(graph, plan, result)
    model = model_trajectory(ops)
    report = {
        "graph": graph.name,
        "planner": plan.planner,
        "budget_bytes": budget,
        "calls": len(ops),
        "model_peak_reserved_bytes": max((r for r, _ in model), default=0),
        "model_peak_allocated_bytes": max((a for _, a in model), default=0),
        "peak_activation_bytes": result.peak_activation_bytes,
        "gpu": None,
    }
    code = 0
    if args.dry_run:
        report["gpu"] = "dry run: not replayed on a GPU"
    else:
        gpu = gpu_trajectory(ops)
        mismatches = [i for i, (m, g) in enumerate(zip(model, gpu, strict=True)) if m != g]
        report["gpu"] = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "peak_reserved_bytes": max((r for r, _ in gpu), default=0),
            "peak_allocated_bytes": max((a for _, a in gpu), default=0),
            "mismatched_calls": len(mismatches),
            "first_mismatch": None
            if not mismatches
            else {"call": mismatches[0], "model": model[mismatches[0]], "gpu": gpu[mismatches[0]]},
        }
        code = 1 if mismatches else 0
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
