"""`python -m pipelines.run [overrides]`: one SlackSwap run, or a sweep with `-m`.

python -m pipelines.run model=gpt2_xl planner=capuchin budget.fraction=0.3
python -m pipelines.run -m model=bert_large,gpt2_xl planner=slackswap,capuchin budget.fraction=0.3,0.5
python -m pipelines.run +experiment=paper
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

import pipelines.schemas  # noqa: F401  (registers the root schema and the repo_root resolver)
from pipelines.job import run_job


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    return run_job(cfg)


if __name__ == "__main__":
    main()
