"""`python -m pipelines.run [overrides]`: one SlackSwap run, or a sweep with `-m`.

python -m pipelines.run model=gpt2_xl planner=capuchin budget.fraction=0.3
python -m pipelines.run -m model=bert_large,gpt2_xl planner=slackswap,capuchin budget.fraction=0.3,0.5
python -m pipelines.run +experiment=paper

Exit codes: 0 done (infeasible budgets included: they are results); 1 a run or a sweep job failed, or
the tracking store cannot be used; 2 a config value is wrong (one line names the field and value);
130 / 143 interrupted by SIGINT / SIGTERM (runs marked KILLED, partial summary written).
"""

from __future__ import annotations

import sys
from typing import Any

import hydra
from omegaconf import DictConfig

import hydra_plugins.slackswap_sweeper  # noqa: F401  (hydra/sweeper=slackswap: basic sweeper + i/N progress)
import pipelines.schemas  # noqa: F401  (registers the root schema and the repo_root resolver)
from pipelines import callbacks, faults, hydra_versions
from pipelines.job import run_job
from pipelines.tracking import TrackingUnavailable
from slackswap.errors import ConfigError

#: Exit code of a config value error, as argparse uses for bad arguments.
EXIT_CONFIG_ERROR = faults.EXIT_CONFIG_ERROR


@hydra.main(**hydra_versions.MAIN_VERSION, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    try:
        if cfg.get("identify") is not None:  # +experiment=seed_identify: the in-process grid, one run
            from pipelines.identify import run_identify

            return run_identify(cfg)
        return run_job(cfg)
    except (ConfigError, TrackingUnavailable) as exc:
        if faults.full_error():
            raise
        code = EXIT_CONFIG_ERROR if isinstance(exc, ConfigError) else 1
        raise faults.Abort(f"error: {exc}", code=code) from None


def cli() -> int:
    callbacks.ACTIVE_SWEEP = None  # a previous sweep in this process (tests) must not set this exit code
    return faults.run_cli(main, callbacks.close_interrupted, callbacks.sweep_exit_code, callbacks.close_failed)


if __name__ == "__main__":
    exit_code = cli()
    if sys.modules["__main__"].__dict__ is globals():  # `python -m pipelines.run`, not runpy from a test
        faults.exit_process(exit_code)
    sys.exit(exit_code)
