"""`hydra/sweeper=slackswap`: Hydra's basic sweeper plus i/N progress (see pipelines/progress.py), and
each job's config composed once instead of twice.

It lives here because Hydra instantiates sweepers only from the `hydra_plugins` namespace.

Why compose once: the basic sweeper composes every job's config before the first job runs (so a bad
override fails the sweep before any work), and the launcher composes it again right before the job.
Composition is Hydra's costliest step per job (about 0.07 s CPU of a 0.37 s budget_curves job).
`ComposeOnceLoader` keeps what the check composed, pickled (about 19 KB a job, pickle is how the
joblib launcher ships configs too), and hands it to the launcher once, in the same process; the
master config's resolver cache is copied onto it again as Hydra's `load_sweep_config` does. A
launcher that composes in other processes (joblib, submitit) gets the plain loader and composes
there, as before.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module without
# registering it in sys.modules, and dataclasses then cannot resolve string annotations.
import json
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf

from pipelines.progress import PROGRESS_FILE


def _plain(loader: Any) -> Any:
    return loader


class ComposeOnceLoader:
    """Hydra's config loader, with the configs the sweeper's check composed kept for the launcher.

    Every attribute but `load_sweep_config` is the wrapped loader's. A kept config is handed out once
    (a second request composes afresh), so no job shares a config object with another. Pickled (a
    joblib or submitit launcher sends the hydra context to its workers), it is the plain loader.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._kept: dict[tuple[int, tuple[str, ...]], bytes] = {}
        #: Compositions done by the wrapped loader (tests count them).
        self.compositions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __reduce__(self) -> Any:
        return (_plain, (self.loader,))

    def _compose(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        self.compositions += 1
        return self.loader.load_sweep_config(master_config=master_config, sweep_overrides=sweep_overrides)

    def compose_and_keep(self, master_config: DictConfig, sweep_overrides: list[str]) -> None:
        """Compose one job's config (raising what Hydra raises for a bad override) and keep it."""
        config = self._compose(master_config, list(sweep_overrides))
        key = (id(master_config), tuple(sweep_overrides))
        self._kept[key] = pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL)

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        kept = self._kept.pop((id(master_config), tuple(sweep_overrides)), None)
        if kept is None:
            return self._compose(master_config, list(sweep_overrides))
        config = pickle.loads(kept)
        # As Hydra's load_sweep_config: the master's resolver cache (timestamps, ...) as of now.
        OmegaConf.copy_cache(from_config=master_config, to_config=config)
        return config


class ProgressSweeper(BasicSweeper):
    def setup(self, *, hydra_context: HydraContext, task_function: Any, config: DictConfig) -> None:
        loader = ComposeOnceLoader(hydra_context.config_loader)
        context = HydraContext(config_loader=loader, callbacks=hydra_context.callbacks)
        super().setup(hydra_context=context, task_function=task_function, config=config)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Hydra's check that every job of the batch composes, keeping the configs for the launcher."""
        assert self.hydra_context is not None and self.config is not None
        loader = self.hydra_context.config_loader
        for overrides in batch:
            loader.compose_and_keep(self.config, list(overrides))

    def split_arguments(self, overrides, max_batch_size):  # type: ignore[override]  (static in the base)
        batches = BasicSweeper.split_arguments(overrides, max_batch_size)
        total = sum(len(batch) for batch in batches)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / PROGRESS_FILE).write_text(json.dumps({"total": total, "started_unix_s": time.time()}) + "\n")
        print(f"sweep: {total} jobs -> {sweep_dir} (checking that every job's config composes first)", flush=True)
        return batches


@dataclass
class ProgressSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.slackswap_sweeper.ProgressSweeper"


ConfigStore.instance().store(group="hydra/sweeper", name="slackswap", node=ProgressSweeperConf, provider="slackswap")
