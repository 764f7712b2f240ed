"""DTR's memoised regeneration chains (`dtr._ChainMemo`) against the plain `analysis.regen_walk`.

At every cost the replay asks for, the memo's op set and stop set must be the walk's, and the cost
the walk's exact sum (`dtr._chain_cost`): on random graphs and on traced graphs (the torch profile
source), whose non-saved residual stream makes chains run back across layers."""

from __future__ import annotations

import math
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.planners.strategies import dtr
from slackswap.planners.support.analysis import regen_walk
from slackswap.schedule import estimate_plan, keep_all_plan
from slackswap.testing import random_graph, toy_hardware

CONF = Path(__file__).resolve().parents[1] / "conf"
MEMO_CHAIN = dtr._ChainMemo.chain  # before any test wraps it


def _replay_checking_chains(graph, hw, monkeypatch) -> tuple[int, int]:
    """Replay DTR at several budgets with every chain checked; (chains checked, replays that evicted)."""
    checked = [0]

    def chain(memo, tensor):
        node = MEMO_CHAIN(memo, tensor)
        missing = set(memo._missing)
        ops, frontier = regen_walk(graph, tensor, missing)
        assert node.ops == ops and node.frontier == frontier, tensor
        cost, _ = dtr._chain_cost(graph, tensor, missing)
        assert math.fsum(graph.op_by_name[o].duration_s for o in node.ops) == cost
        checked[0] += 1
        return node

    monkeypatch.setattr(dtr._ChainMemo, "chain", chain)
    peak = estimate_plan(graph, keep_all_plan(graph), hw).peak_bytes
    evicting = 0
    for fraction in (0.1, 0.3, 0.5, 0.7, 0.9):
        try:
            _, evictions, _ = dtr._dtr_evictions(graph, hw, int(fraction * peak))
        except dtr.DtrCannotFit:
            continue
        evicting += evictions > 0
    return checked[0], evicting


def test_memoised_chains_are_the_walks_on_random_graphs(monkeypatch):
    checked = evicting = 0
    for seed in range(40):
        rng = random.Random(seed)
        graph = random_graph(rng, max_layers=10, real_program=seed % 2 == 1)
        hw = toy_hardware(rng.choice([20.0, 200.0]), rng.choice([20.0, 200.0]))
        c, e = _replay_checking_chains(graph, hw, monkeypatch)
        checked, evicting = checked + c, evicting + e
    assert checked >= 500 and evicting >= 60


def test_memoised_chains_are_the_walks_on_traced_graphs(monkeypatch):
    if not os.environ.get("SLACKSWAP_REQUIRE_TORCH"):  # set by .ci/run: CI never skips this test
        pytest.importorskip("torch", reason="needs the torch extra: pip install -e '.[torch]'")
    from slackswap.profile.torch import build_torch_graph
    from slackswap.profile.torch.spec import TorchSpec

    hw = Hardware.from_dict(yaml.safe_load((CONF / "hardware" / "a100_80gb_pcie4.yaml").read_text()))
    tiny = ModelConfig.from_dict(yaml.safe_load((CONF / "model" / "tiny.yaml").read_text()))
    llama = ModelConfig(name="small_llama", family="llama", num_layers=4, hidden_size=64, num_heads=4,
                        num_kv_heads=2, ffn_hidden_size=128, seq_len=16, micro_batch_size=2, vocab_size=96,
                        dropout=False)
    graphs = [build_torch_graph(tiny, TorchSpec("tiny_gpt"), hw),
              build_torch_graph(replace(tiny, num_layers=4), TorchSpec("tiny_gpt"), hw),
              build_torch_graph(llama, TorchSpec("hf_llama", attention="sdpa"), hw)]
    checked = evicting = 0
    for graph in graphs:
        c, e = _replay_checking_chains(graph, hw, monkeypatch)
        checked, evicting = checked + c, evicting + e
    assert checked >= 100 and evicting >= 6
