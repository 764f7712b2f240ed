"""`hydra/sweeper=slackswap`: Hydra's basic sweeper plus i/N progress (see pipelines/progress.py).

It lives here because Hydra instantiates sweepers only from the `hydra_plugins` namespace.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module without
# registering it in sys.modules, and dataclasses then cannot resolve string annotations.
import json
import time
from dataclasses import dataclass
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore

from pipelines.progress import PROGRESS_FILE


class ProgressSweeper(BasicSweeper):
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
