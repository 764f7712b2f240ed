"""The root schema of `python -m pipelines.advise`: `pipelines.run`'s plus the `advise` node
(conf/advise.yaml documents each key). In its own module, not in the main's: Hydra reads the
dataclasses' type hints through their module, which must be importable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from pipelines.schemas import SlackSwapConfig


@dataclass
class AdviseSchema:
    """`advise.*` (conf/advise.yaml documents each key)."""

    gpus: list[int] = field(default_factory=lambda: [1, 8])
    recipes: list[str] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)
    planners: list[str] = field(default_factory=list)
    plan_against: list[str] = field(default_factory=lambda: ["allocated", "reserved"])
    zero_stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    grad_accum: int = 1
    milp_top_k: int = 2
    graph: str = "analytic"
    top: int = 10
    margin_bytes: int = 0
    tp: list[int] = field(default_factory=lambda: [1])
    pp: list[int] = field(default_factory=lambda: [1])
    cp: list[int] = field(default_factory=lambda: [1])
    ep: list[int] = field(default_factory=lambda: [1])
    sp: bool = True
    pipeline_microbatches: list[int] = field(default_factory=lambda: [8])
    # A schedule name or a list of them (conf/advise.yaml): Any, so that both are taken.
    pipeline_schedule: Any = field(default_factory=lambda: ["1f1b"])
    virtual_stages: list[int] = field(default_factory=lambda: [2])
    layout_top_n: int = 40
    n_jobs: int = 2
    backend: str | None = "loky"


@dataclass
class SlackSwapAdviseConfig(SlackSwapConfig):
    advise: AdviseSchema = field(default_factory=AdviseSchema)


ConfigStore.instance().store(name="slackswap_advise_schema", node=SlackSwapAdviseConfig)
