"""`python -m pipelines.verify_torch model=hf_gpt2_xl model.num_layers=2 [device=cuda]`: trace vs real run.

Runs the model preset's training step for real on `device` (default cuda; `cpu` works anywhere) with
random weights and compares the tensors autograd saves with the meta trace under that device's kernel
semantics, identity by identity (slackswap.profile.torch.verify). Prints the comparison, writes
verify_torch.json into the Hydra run directory, exits 1 when they differ. Shrink the model with
`model.num_layers=...` to fit the device. The GPU check of docs/torch_profile.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import pipelines.schemas  # noqa: F401  (registers the root schema and the repo_root resolver)
from slackswap.errors import ConfigError
from slackswap.model_config import ModelConfig
from slackswap.profile.torch.spec import TorchSpec


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from slackswap.profile.torch.verify import compare_saved

    node = OmegaConf.to_container(cfg.model, resolve=True)
    torch_node = node.pop("torch", None)
    if torch_node is None:
        raise ConfigError("model.torch", None, "the model preset is analytic; pick a traced one (hf_*, tiny_torch)")
    device = str(cfg.get("device", "cuda"))
    result = compare_saved(ModelConfig.from_dict(node), TorchSpec.from_dict(torch_node), device)
    print(result.summary())
    out = Path(HydraConfig.get().runtime.output_dir) / "verify_torch.json"
    out.write_text(json.dumps({"device": result.device, "semantics": result.semantics, "equal": result.equal,
                               "traced": result.traced, "real": result.real}, indent=2, sort_keys=True) + "\n")
    print(f"-> {out}")
    if not result.equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
