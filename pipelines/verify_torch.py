"""`python -m pipelines.verify_torch model=hf_gpt2_xl model.num_layers=2 [+device=cpu]`: trace vs real run.

Runs the model preset's training step for real on `device` (default cuda; `cpu` works anywhere) with
random weights and compares the tensors autograd saves with the meta trace under that device's kernel
semantics, identity by identity (slackswap.profile.torch.verify). Prints the comparison, writes
verify_torch.json into the Hydra run directory, exits 1 when they differ. Shrink the model with
`model.num_layers=...` to fit the device. The GPU check of docs/torch_profile.md.

Exit codes as `pipelines.run`: 0 equal; 1 they differ; 2 a config mistake (one line), among them
`device=cuda` on a torch build or machine without CUDA (a CPU-only wheel).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import pipelines.schemas  # noqa: F401  (registers the root schema and the repo_root resolver)
from pipelines import faults, hydra_versions, overrides
from slackswap.errors import ConfigError
from slackswap.model_config import ModelConfig
from slackswap.profile.torch.spec import TorchSpec


@hydra.main(**hydra_versions.MAIN_VERSION, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        verify(cfg)
    except ConfigError as exc:
        if faults.full_error():
            raise
        raise faults.Abort(f"error: {exc}", code=faults.EXIT_CONFIG_ERROR) from None


def check_device(device: str) -> None:
    """`cuda` needs a torch build with CUDA and a visible GPU: one line naming `device`, not torch's
    `AssertionError: Torch not compiled with CUDA enabled` from deep inside the real run."""
    if device != "cuda":
        return
    from slackswap.profile.torch.workloads import import_torch

    torch = import_torch()
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no GPU visible"
        raise ConfigError("device", device, f"torch {torch.__version__} ({build}) cannot run it; use +device=cpu")


def verify(cfg: DictConfig) -> None:
    from slackswap.profile.torch.verify import compare_saved

    node = OmegaConf.to_container(cfg.model, resolve=True)
    torch_node = node.pop("torch", None)
    if torch_node is None:
        raise ConfigError("model.torch", None, "the model preset is analytic; pick a traced one (hf_*, tiny_torch)")
    overrides.check_traced_attention({"model": {**node, "torch": torch_node}}, list(HydraConfig.get().overrides.task))
    overrides.check_hook({"model": {"torch": torch_node}})
    device = str(cfg.get("device", "cuda"))
    spec = TorchSpec.from_dict(torch_node)
    model = ModelConfig.from_dict(node)
    check_device(device)
    result = compare_saved(model, spec, device)
    print(result.summary())
    out = Path(HydraConfig.get().runtime.output_dir) / "verify_torch.json"
    out.write_text(json.dumps({"device": result.device, "semantics": result.semantics, "equal": result.equal,
                               "traced": result.traced, "real": result.real}, indent=2, sort_keys=True) + "\n")
    print(f"-> {out}")
    if not result.equal:
        sys.exit(1)


def cli() -> int:
    return faults.run_cli(main, lambda interrupted: f"interrupted by {interrupted}", lambda: 0)


if __name__ == "__main__":
    sys.exit(cli())
