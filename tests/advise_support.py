"""What the advise layout tests share: the conf loader, a two-tier topology, the mixed recipe and a
graph builder per micro-batch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from slackswap.communication import Fabric, Topology
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ModelConfig
from slackswap.profile import build_graph

REPO = Path(__file__).resolve().parents[1]
TOPO = Topology(8, Fabric("nvlink", 230e9, 2e-6), Fabric("network", 25e9, 6e-7))
MIXED = TrainingConfig(precision="mixed")


def load_conf(group: str, name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / group / f"{name}.yaml").read_text())


def graphs_of(model: ModelConfig, hardware: Hardware):
    """micro-batch -> the model's graph at that micro-batch, without an optimizer step."""
    return lambda mb: build_graph(replace(model, micro_batch_size=mb, include_optimizer=False), hardware)
