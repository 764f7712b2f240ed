"""Hydra callback that brackets a sweep: MLflow parent run before the jobs, aggregation after.

Why here: `on_multirun_start` runs once in the launching process before any worker exists. Creating
the SQLite schema and the experiment there means parallel workers (joblib, submitit) never race to
create them ("table experiments already exists"). The parent run id is handed to the jobs through a
file in the sweep directory, which every launcher's workers can read (same machine or shared
filesystem) and which, unlike an environment variable, cannot leak into a later run in the same process.

Hydra turns exceptions raised in callbacks into a UserWarning, so failures here are also logged as
errors; a missing parent file makes every job fail loudly (see `pipelines.job.read_parent`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipelines import aggregate, tracking
from pipelines.job import PARENT_FILE
from pipelines.records import RunStatus

log = logging.getLogger(__name__)


class SweepCallback(Callback):
    def __init__(self) -> None:
        self._t_start: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self._t_start = time.perf_counter()
            HydraConfig.instance().set_config(config)  # ${hydra:...} is not set yet on hydra 1.3.8
            sweep_dir = Path(config.hydra.sweep.dir)
            sweep_dir.mkdir(parents=True, exist_ok=True)
            track = OmegaConf.to_container(config.tracking, resolve=True)
            if not track["enabled"]:
                return
            client = tracking.open_client(track["uri"])
            experiment_id = tracking.ensure_experiment(client, track["experiment"], track["artifact_location"])
            experiment_name = OmegaConf.select(config, "experiment.name")
            run_id = tracking.start_run(
                client,
                experiment_id,
                run_name=f"sweep:{experiment_name}:{sweep_dir.name}",
                tags={"sweep_dir": str(sweep_dir.resolve()), "experiment_preset": str(experiment_name)},
                parent_run_id=None,
            )
            tracking.log_params(client, run_id, {"sweep.overrides": " ".join(config.hydra.overrides.task)})
            (sweep_dir / PARENT_FILE).write_text(
                json.dumps({"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": track["uri"]}, indent=2)
            )
            log.info("MLflow parent run %s in experiment %r (%s)", run_id, track["experiment"], track["uri"])
        except Exception:
            log.exception("SweepCallback.on_multirun_start failed: jobs cannot be tracked")
            raise

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            HydraConfig.instance().set_config(config)
            sweep_dir = Path(config.hydra.sweep.dir)
            experiment = OmegaConf.to_container(config.experiment, resolve=True)
            result = aggregate.aggregate_sweep(sweep_dir, experiment)
            print(result.summary_md)
            if result.paper_table_md:
                print(result.paper_table_md)
            parent_file = sweep_dir / PARENT_FILE
            if not parent_file.is_file():
                return
            parent = json.loads(parent_file.read_text())
            client = tracking.open_client(parent["tracking_uri"])
            counts = result.status_counts
            tracking.log_metrics(
                client,
                parent["run_id"],
                {
                    "jobs_total": sum(counts.values()),
                    **{f"jobs_{status.value}": counts.get(status.value, 0) for status in RunStatus},
                    "sweep_wall_s": time.perf_counter() - self._t_start if self._t_start else None,
                },
            )
            tracking.backfill_bound_gaps(client, result.table)
            for path in result.files:
                client.log_artifact(parent["run_id"], str(path))
            tracking.end_run(client, parent["run_id"], RunStatus.OK)
            print(f"aggregate: {sweep_dir} (MLflow parent run {parent['run_id']})")
        except Exception:
            log.exception("SweepCallback.on_multirun_end failed: the sweep was not aggregated")
            raise
