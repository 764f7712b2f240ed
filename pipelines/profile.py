"""`python -m pipelines.profile model=gpt2_xl [hardware=...]`: the profile stage alone.

Prints the per-layer breakdown (`slackswap.profile.report.format_breakdown`) and writes profile.csv
and graph.json into the Hydra run directory. No planner, no simulator, no MLflow: a quick look at what
a model's step costs on a GPU before planning anything.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import pipelines.schemas  # noqa: F401  (registers the root schema and the repo_root resolver)
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from slackswap.graph_io import write_graph_json
    from slackswap.profile.report import format_breakdown, write_profile_csv
    from slackswap.profile.sources import profile_graph

    model = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    hardware = Hardware.from_dict(OmegaConf.to_container(cfg.hardware, resolve=True))
    profile = OmegaConf.to_container(cfg.profile, resolve=True)
    graph = profile_graph(profile["source"], model, hardware, **(profile.get("options") or {}))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    write_profile_csv(graph, run_dir / "profile.csv")
    write_graph_json(graph, run_dir / "graph.json")
    print(format_breakdown(graph))
    print(f"\nprofile.csv, graph.json -> {run_dir}")


if __name__ == "__main__":
    main()
