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

Jobs that differ from an already composed one only in plain values (`budget.fraction=0.3` against
`budget.fraction=0.2`: same keys at the same places, no config group, no `+`/`++`/`~`, no
`@package`, no `hydra.` key, a number, string or boolean) have the same defaults list, so Hydra would
build the same config and then set those leaves. Those jobs start from the composed job's config
and get their values set by Hydra's own override code (`ConfigLoaderImpl._apply_overrides_to_config`),
their `hydra.overrides.task` and `hydra.job.override_dirname` rewritten as Hydra writes them; any error
on that path composes the job from scratch instead, so a bad value fails with Hydra's own message.
Such a job is derived once by the check and again when it launches (about 3 ms), so only one config
per shape is kept, not one per job.
budget_curves composes 33 of its 297 jobs (3 models x 11 planners).
`tests/test_job_overhead.py` compares every job's config files with the basic sweeper's.
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

from pipelines.progress import DONE_FILE, PROGRESS_FILE


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
        #: Per job: its composed config (pickled), or how to derive it (shape key, parsed overrides),
        #: so memory grows with the shapes of a sweep (33 x ~19 KB for budget_curves), not its jobs.
        self._kept: dict[tuple[int, tuple[str, ...]], Any] = {}
        #: Composed configs by (master, shape of the overrides): see `_shape`.
        self._composed_shapes: dict[tuple[int, tuple[str, ...]], bytes] = {}
        self._parser: Any = None
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
        overrides = list(sweep_overrides)
        parsed = self._parse(overrides)
        shape_key = (id(master_config), self._shape(parsed))
        key = (id(master_config), tuple(overrides))
        if shape_key in self._composed_shapes and self._derive(shape_key, parsed) is not None:
            self._kept[key] = (shape_key, parsed)  # derived again, the same way, when the job launches
            return
        blob = pickle.dumps(self._compose(master_config, overrides), protocol=pickle.HIGHEST_PROTOCOL)
        self._composed_shapes.setdefault(shape_key, blob)
        self._kept[key] = blob

    def _derive(self, shape_key: tuple[int, tuple[str, ...]], parsed: list[Any]) -> DictConfig | None:
        return self._with_values(pickle.loads(self._composed_shapes[shape_key]), parsed)

    def _parse(self, overrides: list[str]) -> list[Any]:
        if self._parser is None:
            from hydra.core.override_parser.overrides_parser import OverridesParser

            self._parser = OverridesParser.create(config_loader=self.loader)
        return self._parser.parse_overrides(overrides)

    def _is_plain_value(self, override: Any) -> bool:
        from hydra.core.override_parser.types import OverrideType

        return (
            override.type == OverrideType.CHANGE
            and override.package is None
            and not override.is_sweep_override()
            and not override.is_hydra_override()
            and type(override.value()) in (int, float, str, bool)
            and not self.loader.repository.group_exists(override.key_or_group)
        )

    def _shape(self, parsed: list[Any]) -> tuple[str, ...]:
        """The overrides with each plain value replaced by its key: jobs of one shape have one defaults list."""
        return tuple(
            f"{o.key_or_group}=<value>" if self._is_plain_value(o) else str(o.input_line) for o in parsed
        )

    def _with_values(self, config: DictConfig, parsed: list[Any]) -> DictConfig | None:
        """`config` (composed for another job of the same shape) with this job's plain values set and
        its overrides recorded as Hydra records them; None when that fails (then the job is composed)."""
        from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname

        try:
            ConfigLoaderImpl._apply_overrides_to_config([o for o in parsed if self._is_plain_value(o)], config)
            task = [o for o in parsed if not o.is_hydra_override()]
            config.hydra.overrides.task = [o.input_line for o in task]
            naming = config.hydra.job.config.override_dirname
            config.hydra.job.override_dirname = get_overrides_dirname(
                overrides=task, kv_sep=naming.kv_sep, item_sep=naming.item_sep, exclude_keys=naming.exclude_keys
            )
        except Exception:
            return None
        return config

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        kept = self._kept.pop((id(master_config), tuple(sweep_overrides)), None)
        config = None
        if isinstance(kept, bytes):
            config = pickle.loads(kept)
        elif kept is not None:
            config = self._derive(*kept)
        if config is None:
            return self._compose(master_config, list(sweep_overrides))
        # As Hydra's load_sweep_config: the master's resolver cache (timestamps, ...) as of now.
        OmegaConf.copy_cache(from_config=master_config, to_config=config)
        return config


class ProgressSweeper(BasicSweeper):
    def setup(self, *, hydra_context: HydraContext, task_function: Any, config: DictConfig) -> None:
        loader = ComposeOnceLoader(hydra_context.config_loader)
        context = HydraContext(config_loader=loader, callbacks=hydra_context.callbacks)
        super().setup(hydra_context=context, task_function=task_function, config=config)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Nothing left to check: `split_arguments` composed every job of every batch already."""

    def split_arguments(self, overrides, max_batch_size):  # type: ignore[override]  (static in the base)
        """Hydra's batches; before any job runs, every job's config composed (a bad override or an
        unknown preset fails here, with one line from `pipelines.faults`), and only then the sweep's
        MLflow parent run opened (`pipelines.callbacks.open_parent`): a config mistake leaves no
        empty parent RUNNING."""
        batches = BasicSweeper.split_arguments(overrides, max_batch_size)
        total = sum(len(batch) for batch in batches)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        print(f"sweep: {total} jobs -> {sweep_dir} (checking that every job's config composes first)", flush=True)
        assert self.hydra_context is not None
        loader = self.hydra_context.config_loader
        for batch in batches:
            for job_overrides in batch:
                loader.compose_and_keep(self.config, list(job_overrides))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / PROGRESS_FILE).write_text(json.dumps({"total": total, "started_unix_s": time.time()}) + "\n")
        (sweep_dir / DONE_FILE).write_text("")
        from pipelines import callbacks  # not at plugin scan: it imports the pipeline

        callbacks.open_parent()
        return batches


@dataclass
class ProgressSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.slackswap_sweeper.ProgressSweeper"


ConfigStore.instance().store(group="hydra/sweeper", name="slackswap", node=ProgressSweeperConf, provider="slackswap")
