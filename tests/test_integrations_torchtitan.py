"""A plan as torchtitan's activation-checkpoint settings (slackswap.integrations.torchtitan): the file
is checked against torchtitan's documented schema, since torchtitan does not install beside this
project's pinned torch. The schema: `ActivationCheckpoint` in pytorch/torchtitan
torchtitan/config/job_config.py (commit 000204a4a8bf3d0f31adc44fc29855fbb6ea13d8): `mode` a Literal of
"selective", "full", "none"; `selective_ac_option` a str, "op" or an integer N >= 0 (every Nth block,
counted from 1, is checkpointed); `per_op_sac_force_recompute_mm_shapes_by_fqns` a list of str."""

from __future__ import annotations

import tomllib

import pytest

from slackswap.graph import NO_LAYER
from slackswap.integrations.torchtitan import torchtitan_settings
from slackswap.plan import Decision, Plan
from slackswap.testing import bwd, fwd, make_graph

SCHEMA = {"mode": {"selective", "full", "none"}, "selective_ac_option": str,
          "per_op_sac_force_recompute_mm_shapes_by_fqns": list}  # fmt: skip


def _graph(layers: int = 4):
    """A chain of `layers` blocks, two saved tensors each (a{i}, x{i}), and an embedding outside them."""
    specs = [fwd("emb", [], ["x0"], 1e-3, layer=NO_LAYER)]
    specs += [s for i in range(layers) for s in (fwd(f"f{i}a", [f"x{i}"], [f"a{i}"], 1e-3, layer=i),
                                               fwd(f"f{i}b", [f"a{i}"], [f"x{i + 1}"], 1e-3, layer=i))]
    specs += [fwd("loss", [f"x{layers}"], ["l"], 1e-3, layer=NO_LAYER), bwd("dl", ["l"], ["g"], 1e-3, NO_LAYER)]
    specs += [bwd(f"b{i}", [f"a{i}", f"x{i}", "g"], [f"g{i}"], 1e-3, layer=i) for i in reversed(range(layers))]
    sizes = {t: 100 for s in specs for t in s.outputs}
    return make_graph(specs, sizes)


def _plan(graph, recompute_layers=(), swap=(), partial=()):
    decisions = {}
    for name, t in graph.tensors.items():
        if not t.saved:
            continue
        d = Decision.KEEP
        if t.layer in recompute_layers or (t.layer in partial and name.startswith("a")):
            d = Decision.RECOMPUTE
        if name in swap:
            d = Decision.SWAP
        decisions[name] = d
    return Plan(planner="hand", budget_bytes=None, decisions=decisions, steps=())


def _check_schema(text: str) -> dict:
    table = tomllib.loads(text)["activation_checkpoint"]
    assert set(table) <= set(SCHEMA)
    assert table["mode"] in SCHEMA["mode"]
    option = table["selective_ac_option"]
    assert isinstance(option, str) and (option == "op" or int(option) >= 0)
    return table


@pytest.mark.parametrize(("recompute", "mode", "option", "checkpointed"), [
    ((), "none", "2", ()),
    ((0, 1, 2, 3), "full", "2", (0, 1, 2, 3)),
    ((1, 3), "selective", "2", (1, 3)),
    ((3,), "selective", "4", (3,)),
])  # fmt: skip
def test_layer_recomputes_become_torchtitan_settings(recompute, mode, option, checkpointed) -> None:
    graph = _graph()
    settings = torchtitan_settings(_plan(graph, recompute), graph)
    assert (settings.mode, settings.selective_ac_option, settings.checkpointed_layers) == (mode, option, checkpointed)
    assert settings.not_expressed == ()
    table = _check_schema(settings.toml())
    assert (table["mode"], table["selective_ac_option"]) == (mode, option)


def test_what_the_settings_cannot_say_is_named() -> None:
    graph = _graph()
    # layer 1 recomputed in part, layer 2 whole: the period covering both is 1 (every layer)
    settings = torchtitan_settings(_plan(graph, recompute_layers=(2,), swap=("x0",), partial=(1,)), graph)
    assert settings.mode == "full" and settings.checkpointed_layers == (0, 1, 2, 3)
    text = "\n".join(settings.not_expressed)
    assert "1 swapped tensors (100 B)" in text
    assert "layer 1: the plan recomputes 1 of its 2 saved tensors" in text
    assert "layers [0, 3]: recomputed whole" in text
    assert all(f"# not expressed: {line}" in settings.toml() for line in settings.not_expressed)
    _check_schema(settings.toml())
