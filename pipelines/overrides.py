"""Checks of what the user wrote on the command line that the resolved config no longer shows.

A traced preset (`model=hf_llama7b`, a `model.torch` node) builds its graph from
`model.torch.attention`; its `model.attention` only names the analytic twin it is compared with.
`model.attention=eager` on the command line would therefore change nothing, silently: it is refused,
naming the key that does set the traced attention. On an analytic preset, or with `profile=torch`
(the family's transformers class, whose attention follows `model.attention`), it is the key to use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slackswap.errors import ConfigError


def override_values(task_overrides: Sequence[str]) -> dict[str, str]:
    """{key: value} of Hydra's task overrides (`+`/`++`/`~` prefixes dropped)."""
    out: dict[str, str] = {}
    for item in task_overrides:
        key, sep, value = str(item).partition("=")
        if sep:
            out[key.lstrip("+~")] = value
    return out


def check_traced_attention(resolved: Mapping[str, Any], task_overrides: Sequence[str]) -> None:
    torch_node = (resolved.get("model") or {}).get("torch")
    if not torch_node:
        return
    value = override_values(task_overrides).get("model.attention")
    if value is None:
        return
    raise ConfigError(
        "model.attention",
        value,
        f"ignored by a traced preset: its graph follows model.torch.attention "
        f"(now {torch_node.get('attention')!r}); set model.torch.attention=eager or =sdpa instead",
    )


def check_hook(resolved: Mapping[str, Any]) -> None:
    """A user's model hook (`builder: hook`) is imported before anything is recorded: a hook that cannot
    be imported is a config mistake (exit 2, one line with what to check), not a failed run found
    by the profile stage after the MLflow run exists."""
    profile = resolved.get("profile") or {}
    for node in ((resolved.get("model") or {}).get("torch"), profile.get("options") if profile.get("source") == "torch"
                 else None):
        if node and node.get("builder") == "hook" and node.get("hook"):
            from slackswap.profile.torch.workloads import hook_function

            hook_function(str(node["hook"]))
