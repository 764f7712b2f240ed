"""`python -m pipelines.advise [overrides]`: will my model fit, and how fast? The fastest fitting
training configuration on this GPU and node, for one GPU and for N.

python -m pipelines.advise model=hf_llama7b hardware=a100_80gb_pcie4 node=dgx_a100
python -m pipelines.advise model=llama7b advise.gpus=[1,8,16] advise.recipes=[adamw_mixed]

Searches micro-batch, ZeRO stage and shards, the training recipes, the planners and the planning
target (allocated or reserved peak); `slackswap.experiment.advise` does the work, docs/advise.md says
how; `slackswap.experiment.advise_spec` checks the inputs. Writes advice.json, advice.md and
advise_pareto.png to outputs/<date>/<time>/, one MLflow parent run (every configuration in its
advice.json) with a child per answer row (the best per GPU count and recipe). Exit codes as
`pipelines.run`: 2 a config value is wrong (one line naming the field and value), 1 the tracking store
cannot be used, 130 / 143 interrupted.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import pipelines.advise_schema  # noqa: F401  (registers slackswap_advise_schema and the repo_root resolver)
from pipelines import advise_report, faults, hydra_versions
from pipelines.job import resolve_config
from pipelines.schemas import REPO_ROOT
from pipelines.tracking import TrackingUnavailable
from slackswap.errors import ConfigError
from slackswap.experiment.advise_spec import AdviseSpec

EXIT_CONFIG_ERROR = 2
#: The rows of advice.json, one JSON object a line, appended as the search evaluates them; removed
#: once advice.json is written, kept by an interrupted search.
PARTIAL_FILE = "advice_partial.jsonl"
#: The partial file of the search in progress and how many rows it holds (for the interrupt line).
EVALUATED: dict[str, Any] = {"path": None, "rows": 0}
#: The config groups whose presets the search names (`advise.recipes`, `advise.planners`).
PRESET_GROUPS = ("training", "planner")


class _Presets(Mapping[str, Mapping[str, Any]]):
    """The presets of one `conf/<group>/` folder by name, each read (and its interpolations resolved)
    when the spec asks for it: the spec names the known ones in an error, and reads only those searched."""

    def __init__(self, group: str) -> None:
        self.folder = REPO_ROOT / "conf" / group
        self.names = sorted(p.stem for p in self.folder.glob("*.yaml"))

    def __getitem__(self, name: str) -> Mapping[str, Any]:
        if name not in self.names:
            raise KeyError(name)
        return OmegaConf.to_container(OmegaConf.load(self.folder / f"{name}.yaml"), resolve=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def conf_presets() -> dict[str, Mapping[str, Mapping[str, Any]]]:
    """The presets `AdviseSpec.from_dict` may name, from `conf/`."""
    return {group: _Presets(group) for group in PRESET_GROUPS}


def advise(cfg: DictConfig) -> dict[str, Any]:
    t_start = time.perf_counter()
    hc = HydraConfig.get()
    choices = {k: str(v) for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and v is not None}
    # planner and training are searched, not chosen: they stay out of the config (the spec says so if set).
    keys = [k for k in cfg if k not in ("planner", "training") or k in choices]
    resolved = resolve_config(OmegaConf.masked_copy(cfg, keys))
    spec = AdviseSpec.from_dict(resolved, conf_presets(), choices)
    run_dir = Path(hc.runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    faults.note_output_dir(run_dir)
    header = {"model": choices.get("model", spec.model.name),
              "hardware": choices.get("hardware", spec.hardware.name),
              "node": choices.get("node", spec.node.name), "seq_len": spec.model.seq_len,
              "device_memory_bytes": spec.hardware.device_memory_bytes}
    track = resolved["tracking"]
    client = info = None
    if track.get("enabled"):
        name = f"advise · {header['model']} · {header['hardware']} · {header['node']}"
        params = {"model": header["model"], "hardware": header["hardware"], "node": header["node"],
                  **{f"advise.{k}": str(v) for k, v in resolved["advise"].items()},
                  "budget.reserve_bytes": str(spec.space.reserve_bytes)}
        client, experiment_id, info = advise_report.start_parent(track, name, params)

    partial = run_dir / PARTIAL_FILE
    partial.unlink(missing_ok=True)
    EVALUATED.update(path=partial, rows=0)

    def progress(i: int, n: int, row: Any) -> None:
        # Each configuration reaches the disk as it is evaluated: an interrupted search keeps them.
        with partial.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row.to_json(), default=str) + "\n")
        EVALUATED["rows"] = i
        c = row.candidate
        tps = "-" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f} tok/s/GPU"
        print(f"[{i}/{n} {time.perf_counter() - t_start:5.1f} s] {c.layout.label}, {c.recipe}, mb {c.micro_batch}, "
              f"{c.planner}/{c.plan_against}: {tps}{'' if row.fits_device else ' (does not fit)'}", flush=True)

    advice = spec.search(on_row=progress)
    search_s = time.perf_counter() - t_start
    data = advise_report.write_outputs(run_dir, advice, spec, header)
    partial.unlink(missing_ok=True)  # advice.json has every row now
    EVALUATED.update(path=None, rows=0)
    children, children_s = 0, 0.0
    if client is not None:
        children, children_s = advise_report.log_configurations(client, experiment_id, info.run_id, data)
        advise_report.finish_parent(client, info, track, run_dir, advise_report.parent_metrics(
            advice, search_s, children_s), (run_dir / "advice.md").read_text())
    print(advise_report.stdout_summary(advice, spec, header, search_s))
    mlflow_note = (f"; MLflow: parent {info.run_id} (every configuration in its advice.json), {children} children "
                   f"(the best per GPU count and recipe, {children_s:.1f} s)") if info else ""
    print(f"\nadvice.json, advice.md, advise_pareto.png in {run_dir}{mlflow_note}; "
          f"{time.perf_counter() - t_start:.1f} s in all")
    return data


@hydra.main(**hydra_versions.MAIN_VERSION, config_path="../conf", config_name="advise")
def main(cfg: DictConfig) -> dict[str, Any]:
    try:
        return advise(cfg)
    except (ConfigError, TrackingUnavailable) as exc:
        if faults.full_error():
            raise
        code = EXIT_CONFIG_ERROR if isinstance(exc, ConfigError) else 1
        raise faults.Abort(f"error: {exc}", code=code) from None


def _on_interrupt(exc: faults.Interrupted) -> str:
    faults.kill_in_flight_except(None)
    kept = ""
    if EVALUATED.get("path") is not None:
        kept = f"; {EVALUATED['rows']} configuration(s) evaluated so far kept in {EVALUATED['path']}"
    return f"interrupted by {exc}{kept}{faults.interrupted_tail()}"


def cli() -> int:
    EVALUATED.update(path=None, rows=0)  # a previous advice in this process (tests)
    return faults.run_cli(main, _on_interrupt, lambda: 0)


if __name__ == "__main__":
    exit_code = cli()
    if sys.modules["__main__"].__dict__ is globals():
        faults.exit_process(exit_code)
    sys.exit(exit_code)
