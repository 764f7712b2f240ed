"""`python -m pipelines.profile model=gpt2_xl [hardware=...]`: the profile stage alone.

Prints the per-layer breakdown (`slackswap.profile.report.format_breakdown`) and writes profile.csv
and graph.json into the Hydra run directory. No planner, no simulator, no MLflow: a quick look at what
a model's step costs on a GPU before planning anything. The graph comes from the `profile` source
(`profile=analytic` by default). With a traced preset (`model=hf_gpt2_xl`) the
breakdown is the real model's, and profile.csv compares each layer with the analytic graph's bytes.

Exit codes as `pipelines.run`: 0 done; 2 a config value is wrong (one line names the field and value);
130 / 143 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import pipelines.schemas  # noqa: F401  (registers the root schema and the repo_root resolver)
from pipelines import faults, hydra_versions, overrides
from slackswap.errors import ConfigError
from slackswap.experiment.baseline import analytic_twin
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.parallel import ParallelConfig

#: Exit code of a config value error, as in `pipelines.run`.
EXIT_CONFIG_ERROR = faults.EXIT_CONFIG_ERROR


@hydra.main(**hydra_versions.MAIN_VERSION, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        profile_stage(cfg)
    except ConfigError as exc:
        if faults.full_error():
            raise
        raise faults.Abort(f"error: {exc}", code=EXIT_CONFIG_ERROR) from None


def profile_stage(cfg: DictConfig) -> None:
    from slackswap.graph_io import write_graph_json
    from slackswap.profile import build_graph
    from slackswap.profile.report import format_breakdown, write_profile_csv
    from slackswap.profile.sources import profile_graph, select_source
    from slackswap.profile.torch import spec_from_options

    node = OmegaConf.to_container(cfg.model, resolve=True)
    overrides.check_traced_attention({"model": node}, list(HydraConfig.get().overrides.task))
    overrides.check_hook({"model": node, "profile": OmegaConf.to_container(cfg.profile, resolve=True)})
    torch_node = node.pop("torch", None)
    profile = OmegaConf.to_container(cfg.profile, resolve=True)
    source, options = select_source(profile["source"], profile.get("options") or {}, torch_node)
    model = ModelConfig.from_dict(node)
    hardware = Hardware.from_dict(OmegaConf.to_container(cfg.hardware, resolve=True))
    parallel = ParallelConfig.from_dict(OmegaConf.to_container(cfg.parallel, resolve=True))
    graph = profile_graph(source, model, hardware, None, parallel, **options)  # one rank's graph under a layout
    reference = None
    if source == "torch" and options.get("builder") not in ("hook", "hf"):  # no analytic twin of a user's module
        reference = build_graph(analytic_twin(model, spec_from_options(model, options)), hardware)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    write_profile_csv(graph, run_dir / "profile.csv", reference=reference)
    write_graph_json(graph, run_dir / "graph.json")
    print(format_breakdown(graph))
    print(f"\nprofile.csv, graph.json -> {run_dir}")


def cli() -> int:
    """One line and exit code 2 for a bad config value (as `pipelines.run`), not Hydra's traceback."""
    return faults.run_cli(main, lambda interrupted: f"interrupted by {interrupted}", lambda: 0)


if __name__ == "__main__":
    sys.exit(cli())
