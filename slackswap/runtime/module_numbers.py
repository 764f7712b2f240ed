"""The Python numbers a model's modules hold: where they are kept, for the checks that compare them
between steps (`eager.module_calls.ModuleState`) and the export's recompute that starts from them
(`export.replayed_state`)."""

from __future__ import annotations

import torch


def number_slots(modules: list[torch.nn.Module]) -> tuple[tuple[object, str], ...]:
    """(attribute table, key) of each attribute holding a number (int, float, bool): the modules' own, their
    classes' (below `torch.nn.Module`; a table there is a mappingproxy) and the plain objects' they hold."""
    tables = [m.__dict__ for m in modules] + _held_objects(modules) + _class_tables(modules)
    return tuple((table, key) for table in tables for key, value in table.items() if type(value) in (int, float, bool))


def _class_tables(modules: list[torch.nn.Module]) -> list[object]:
    """The attribute tables of the modules' own classes and their bases below `torch.nn.Module`, each once: a
    class attribute a forward reads through `self` (`LlamaAttention.is_causal`; a scale the loop sets on the
    class) is a number of the model too."""
    seen: set[type] = set()
    tables: list[object] = []
    for module in modules:
        for cls in type(module).__mro__:
            if cls in seen or cls is torch.nn.Module or not issubclass(cls, torch.nn.Module):
                continue
            seen.add(cls)
            tables.append(cls.__dict__)
    return tables


def _held_objects(modules: list[torch.nn.Module], depth: int = 2) -> list[dict]:
    """The attribute tables (`__dict__`) of the plain objects the modules hold, and of the objects those
    hold, `depth` levels down, each once: a model's config and its sub-configs. Modules, tensors, classes
    and callables are not plain objects."""
    seen: set[int] = set()
    found: list[dict] = []
    level = [m.__dict__ for m in modules]
    for _ in range(depth):
        below = []
        for table in level:
            for value in table.values():
                attributes = getattr(value, "__dict__", None)
                if (type(attributes) is not dict or id(value) in seen or callable(value)
                        or isinstance(value, (torch.nn.Module, torch.Tensor, type))):
                    continue
                seen.add(id(value))
                below.append(attributes)
        found += below
        level = below
    return found


__all__ = ["number_slots"]
