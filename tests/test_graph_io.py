"""graph.json: lossless round trip and schema checks."""

import json
from pathlib import Path

import pytest
import yaml

from slackswap.errors import ConfigError
from slackswap.graph_io import GRAPH_SCHEMA_VERSION, graph_from_dict, graph_to_dict, read_graph_json, write_graph_json
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.profile import build_graph

CONF = Path(__file__).resolve().parents[1] / "conf"
HW = Hardware.from_dict(yaml.safe_load((CONF / "hardware" / "gh200_c2c.yaml").read_text()))


def graph(name="tiny", **overrides):
    data = {**yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()), **overrides}
    return build_graph(ModelConfig.from_dict(data), HW)


@pytest.mark.parametrize("overrides", [{}, {"include_optimizer": True}])
def test_round_trip_is_equal(tmp_path, overrides):
    g = graph(**overrides)
    path = write_graph_json(g, tmp_path / "graph.json")
    back = read_graph_json(path)
    assert back == g
    assert back.saved_tensors == g.saved_tensors
    assert json.loads(path.read_text())["schema_version"] == GRAPH_SCHEMA_VERSION


def test_round_trip_of_a_flash_gqa_graph():
    g = graph("llama2_70b", num_layers=2)
    assert graph_from_dict(json.loads(json.dumps(graph_to_dict(g)))) == g


def test_a_changed_duration_is_not_equal():
    g = graph()
    data = graph_to_dict(g)
    data["ops"][3]["duration_s"] *= 2
    assert graph_from_dict(data) != g


def test_schema_version_is_checked(tmp_path):
    data = graph_to_dict(graph())
    data["schema_version"] = GRAPH_SCHEMA_VERSION + 1
    with pytest.raises(ConfigError, match=rf"graph.schema_version={GRAPH_SCHEMA_VERSION + 1}"):
        graph_from_dict(data)
    data["schema_version"] = GRAPH_SCHEMA_VERSION
    data["schema"] = "slackswap.plan"
    with pytest.raises(ConfigError, match=r"graph.schema='slackswap.plan'"):
        graph_from_dict(data)


def test_unknown_or_missing_fields_are_rejected():
    data = graph_to_dict(graph())
    del data["tensors"][0]["saved"]
    with pytest.raises(ConfigError, match=r"saved"):
        graph_from_dict(data)


def test_a_version_1_file_is_read_with_the_new_fields_at_their_defaults():
    g = graph()
    data = graph_to_dict(g)
    data["schema_version"] = 1
    for rec in data["ops"]:
        for key in ("random", "writes", "attention_core"):
            del rec[key]
    for rec in data["tensors"]:
        del rec["base"], rec["held_until"]
    old = graph_from_dict(data)
    assert [op.name for op in old.ops] == [op.name for op in g.ops]
    assert not any(op.random or op.writes or op.attention_core for op in old.ops)
    assert not any(t.base for t in old.tensors.values())
    # a version-2 field in a version-1 file is not silently accepted
    data["ops"][0]["random"] = True
    with pytest.raises(ConfigError, match="random"):
        graph_from_dict(data)


def test_new_fields_round_trip_on_a_graph_with_views_in_place_and_random_ops():
    from slackswap.testing import aliasing_graph

    g = aliasing_graph()
    assert graph_from_dict(json.loads(json.dumps(graph_to_dict(g)))) == g


def test_a_version_2_file_is_read_with_no_holds_and_holds_round_trip():
    from dataclasses import replace

    g = graph()
    data = graph_to_dict(g)
    data["schema_version"] = 2
    for rec in data["tensors"]:
        del rec["held_until"]
    assert graph_from_dict(data) == g and not g.has_holds
    first = next(iter(g.tensors.values()))
    held = replace(g, tensors={**g.tensors, first.name: replace(first, held_until=g.ops[-1].name)})
    assert held.has_holds and held.fingerprint != g.fingerprint
    assert graph_from_dict(graph_to_dict(held)) == held
