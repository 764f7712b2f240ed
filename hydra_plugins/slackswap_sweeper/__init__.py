"""`hydra/sweeper=slackswap`: Hydra's basic sweeper plus i/N progress (see pipelines/progress.py), and
each job's config composed once instead of twice.

Written against Hydra's public plugin API only (`hydra.plugins.sweeper.Sweeper`, the public
`ConfigLoader` interface, `OverridesParser`, `Plugins`), so it runs on Hydra 1.3 and 1.4: the basic
sweeper itself lives in `hydra._internal` and moved between the two. Its behaviour is restated here:
the cartesian product of the sweep overrides in command-line order, `hydra.sweeper.params` first,
batches of `max_batch_size`, `multirun.yaml` in the sweep folder.

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
and get their values set as Hydra sets a changed value (`OmegaConf.update(..., merge=True)`), their
`hydra.overrides.task` and (on Hydra 1.3, where it is a value, not a resolver) `hydra.job.override_dirname`
rewritten as Hydra writes them; any error
on that path composes the job from scratch instead, so a bad value fails with Hydra's own message.
Such a job is derived once by the check and again when it launches (about 3 ms), so only one config
per shape is kept, not one per job.
budget_curves composes 33 of its 297 jobs (3 models x 11 planners).
`tests/test_job_overhead.py` compares every job's config files with the basic sweeper's.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module without
# registering it in sys.modules, and dataclasses then cannot resolve string annotations.
import itertools
import json
import pickle
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
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
        self._group_names: frozenset[str] | None = None
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
            self._parser = OverridesParser.create(config_loader=self.loader)
        return self._parser.parse_overrides(overrides)

    def _is_group(self, name: str) -> bool:
        """Is `name` a config group (`model`, `hydra/launcher`)? From the loader's public `list_groups`."""
        if self._group_names is None:
            names: set[str] = set()
            parents = [""]
            while parents:
                parent = parents.pop()
                for child in self.loader.list_groups(parent):
                    name_of_child = f"{parent}/{child}" if parent else child
                    names.add(name_of_child)
                    parents.append(name_of_child)
            self._group_names = frozenset(names)
        return name in self._group_names

    def _is_plain_value(self, override: Any) -> bool:
        from hydra.core.override_parser.types import OverrideType

        return (
            override.type == OverrideType.CHANGE
            and override.package is None
            and not override.is_sweep_override()
            and not override.is_hydra_override()
            and type(override.value()) in (int, float, str, bool)
            and not self._is_group(override.key_or_group)
        )

    def _shape(self, parsed: list[Any]) -> tuple[str, ...]:
        """The overrides with each plain value replaced by its key: jobs of one shape have one defaults list."""
        return tuple(
            f"{o.key_or_group}=<value>" if self._is_plain_value(o) else str(o.input_line) for o in parsed
        )

    def _with_values(self, config: DictConfig, parsed: list[Any]) -> DictConfig | None:
        """`config` (composed for another job of the same shape) with this job's plain values set and
        its overrides recorded as Hydra records them; None when that fails (then the job is composed)."""
        try:
            for override in parsed:
                if self._is_plain_value(override):
                    OmegaConf.update(config, override.key_or_group, override.value(), merge=True)
            task = [o for o in parsed if not o.is_hydra_override()]
            config.hydra.overrides.task = [o.input_line for o in task]
            if not OmegaConf.is_interpolation(config.hydra.job, "override_dirname"):
                naming = config.hydra.job.config.override_dirname
                config.hydra.job.override_dirname = overrides_dirname(
                    task, exclude_keys=naming.exclude_keys, item_sep=naming.item_sep, kv_sep=naming.kv_sep
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


def overrides_dirname(overrides: Sequence[Any], exclude_keys: Sequence[str], item_sep: str, kv_sep: str) -> str:
    """`hydra.job.override_dirname` as Hydra 1.3 writes it: the task overrides not excluded, sorted, joined."""
    lines = sorted(o.input_line for o in overrides if o.key_or_group not in exclude_keys)
    return re.sub("[=]", kv_sep, item_sep.join(lines))


def sweep_jobs(overrides: Sequence[Any]) -> list[list[str]]:
    """Every job's overrides: the cartesian product of the sweep overrides, in command-line order (a key
    given twice keeps its last value at its first place), as Hydra's basic sweeper builds them."""
    per_key: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            per_key[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            per_key[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise HydraException(f"ProgressSweeper does not support sweep type : {override.value_type.name}")
    return [list(job) for job in itertools.product(*per_key.values())]


class ProgressSweeper(Sweeper):
    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None) -> None:
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        loader = ComposeOnceLoader(hydra_context.config_loader)
        self.hydra_context = HydraContext(config_loader=loader, callbacks=hydra_context.callbacks)
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=self.hydra_context, task_function=task_function, config=config
        )

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Nothing left to check: `split_arguments` composed every job of every batch already."""

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.hydra_context is not None and self.launcher is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*(f"{k}={v}" for k, v in self.params.items()), *arguments])
        batches = self.split_arguments(overrides, self.max_batch_size)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns = []
        initial_job_idx = 0
        for batch in batches:
            results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            for result in results:
                _ = result.return_value  # raises a failed job's exception, as Hydra's sweepers do
            initial_job_idx += len(batch)
            returns.append(results)
        return returns

    def split_arguments(self, overrides: Sequence[Any], max_batch_size: int | None) -> list[list[list[str]]]:
        """Hydra's batches; before any job runs, every job's config composed (a bad override or an
        unknown preset fails here, with one line from `pipelines.faults`), and only then the sweep's
        MLflow parent run opened (`pipelines.callbacks.open_parent`): a config mistake leaves no
        empty parent RUNNING."""
        jobs = sweep_jobs(overrides)
        size = len(jobs) if max_batch_size in (None, -1) else max_batch_size
        assert size > 0
        batches = [jobs[i : i + size] for i in range(0, len(jobs), size)]
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
class ProgressSweeperConf:
    _target_: str = "hydra_plugins.slackswap_sweeper.ProgressSweeper"
    max_batch_size: int | None = None
    params: dict[str, str] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="slackswap", node=ProgressSweeperConf, provider="slackswap")
