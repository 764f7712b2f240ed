"""pipelines.config_yaml writes and reads resolved configs exactly as OmegaConf's public API does."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf

from pipelines.config_yaml import dump_config, load_config

TRICKY = {
    "plain": "slackswap",
    "looks_bool": "true",
    "looks_yes": "yes",
    "looks_int": "10",
    "looks_float_12": "1e-5",
    "looks_float_11": "1.5e-3",
    "looks_null": "null",
    "looks_date": "2026-12-04",
    "looks_inf": ".inf",
    "colon": "a: b",
    "empty": "",
    "int": 3,
    "float": 1e-5,
    "big_float": 2.5e11,
    "negative": -0.25,
    "bool": False,
    "none": None,
    "list": [1, "2", 3.0, "off"],
    "nested": {"fraction": 0.5, "bytes": 20000000000, "name": "a100_80gb_pcie4"},
    "unicode": "µs",
}


def test_dump_gives_omegaconfs_own_text():
    assert dump_config(TRICKY) == OmegaConf.to_yaml(OmegaConf.create(TRICKY))


def test_load_gives_omegaconfs_own_values_and_round_trips():
    text = OmegaConf.to_yaml(OmegaConf.create(TRICKY))
    assert load_config(text) == OmegaConf.to_container(OmegaConf.create(text)) == TRICKY
    assert load_config(dump_config(TRICKY)) == TRICKY


@pytest.mark.parametrize("text", ["a: 1e-5", "a: 1_000.5", "a: 2026-12-04", "a: .NaN"])
def test_scalars_read_as_omegaconf_reads_them(text):
    ours = load_config(text)["a"]
    theirs = OmegaConf.to_container(OmegaConf.create(text))["a"]
    assert type(ours) is type(theirs)
    assert ours == theirs or (ours != ours and theirs != theirs)  # NaN


def test_a_duplicate_key_is_refused():
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key a"):
        load_config("a: 1\na: 2\n")
