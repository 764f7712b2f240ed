"""Reading and writing resolved configs as YAML the way OmegaConf does, through PyYAML's public API.

Why not OmegaConf: `OmegaConf.to_yaml` / `OmegaConf.load` on a plain dict first build a DictConfig
(two thirds of the call's cost, paid by every job of a sweep), and the shortcuts OmegaConf uses inside
(`omegaconf._utils.get_yaml_loader`, `get_omega_conf_dumper`) are private: omegaconf 2.4 renamed them
and the pipeline failed at import. The two rules that make OmegaConf's YAML differ from PyYAML's
defaults are restated here:

- floats are read as YAML 1.2 writes them (`1e-5` is a float, PyYAML's YAML 1.1 resolver reads it as
  a string), and timestamps are not a type (`2026-12-04` stays a string);
- a string that would read back as another type (`'true'`, `'10'`, `'1e-5'`) is written quoted.

`tests/test_config_yaml.py` holds both to OmegaConf's own public `to_yaml` and `create`, value by value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml

_FLOAT_TAG = "tag:yaml.org,2002:float"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_STR_TAG = "tag:yaml.org,2002:str"

#: YAML 1.2's float forms (with digits grouped by `_` and sexagesimal, as YAML 1.1 also allows).
_YAML12_FLOAT = re.compile(
    r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats, no timestamps, and duplicate keys refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag != _STR_TAG:
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key_node.value}",
                    key_node.start_mark,
                )  # fmt: skip
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver(_FLOAT_TAG, _YAML12_FLOAT, list("-+0123456789."))
ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _TIMESTAMP_TAG]
    for first, resolvers in ConfigLoader.yaml_implicit_resolvers.items()
}


def _reads_back_as_another_type(text: str) -> bool:
    """Would `text`, written plain, be read by `ConfigLoader` (or YAML 1.1) as something else than a string?"""
    if _YAML12_FLOAT.match(text):
        return True
    resolved = yaml.SafeLoader.resolve(yaml.SafeLoader, yaml.ScalarNode, text, (True, False))
    return resolved != _STR_TAG


class ConfigDumper(yaml.Dumper):
    """PyYAML's dumper; strings that would read back as another type are single-quoted."""


def _represent_str(dumper: yaml.Dumper, data: str) -> yaml.ScalarNode:
    style = "'" if _reads_back_as_another_type(data) else None
    return dumper.represent_scalar(_STR_TAG, data, style=style)


ConfigDumper.add_representer(str, _represent_str)


def dump_config(resolved: Mapping[str, Any]) -> str:
    """The text `OmegaConf.to_yaml(resolved)` gives for a plain resolved config."""
    return yaml.dump(resolved, Dumper=ConfigDumper, default_flow_style=False, allow_unicode=True, sort_keys=False)


def load_config(text: str) -> Any:
    """The plain containers `OmegaConf.to_container(OmegaConf.create(text))` gives."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader subclass)
