"""One process's plan in a multi-process step: what runs (FSDP2) and what is refused (imports torch).

Each process (rank) captures and plans its own step: the graph is the rank's (its batch, its
sharded parameters gathered per layer, the collectives' buffers), the budget is the rank's, and
the runtime runs on the rank's device. That is sound when the step a rank runs is the same ATen
sequence every step and what the collectives read and write is the model's state, not an
activation, which is what FSDP2 (`torch.distributed.fsdp.fully_shard`) does after its first step:
its parameters' all-gather outputs are storages kept for the model's life, emptied after each use
and refilled before the next (`slackswap.runtime.eager.verified.model_storages`).

FSDP2's first step is not like the others: its lazy initialisation and the first all-gather of each
parameter group allocate those storages (ATen calls no later step makes), so a plan captured on it
describes a step that never recurs. `settle_fsdp2` runs that first step plain, before the capture,
under `fork_rng` and with the gradients it makes dropped (those before it restored), as the capture
itself does: the training is the one without the plan.

Refused, one line each, before the first step: DDP (its reducer's bucketed all-reduce runs inside
backward from autograd hooks the runtime has not been checked against), FSDP1
(`FullyShardedDataParallel`: flat parameters re-viewed every step), DeepSpeed engines, and the export
executor under FSDP2 (untested there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from slackswap.integrations.planning import IntegrationError

#: Wrappers a plan does not run under, by class name (no import of their packages): why, in a line.
REFUSED_WRAPPERS = {
    "DistributedDataParallel": "DDP's bucketed all-reduce runs inside backward from autograd hooks the runtime "
                               "is not tested with; shard with FSDP2 (torch.distributed.fsdp.fully_shard) instead",
    "FullyShardedDataParallel": "FSDP1's flat parameters are re-viewed every step; use FSDP2 "
                                "(torch.distributed.fsdp.fully_shard)",
    "DeepSpeedEngine": "DeepSpeed's engine runs its own backward and partitioning; use FSDP2 "
                       "(torch.distributed.fsdp.fully_shard)",
}


def _fsdp2_params(model: torch.nn.Module) -> list[object] | None:
    """The FSDPParams of every FSDP2 module in `model`, or None when no module is sharded by FSDP2."""
    found: list[object] | None = None
    for module in model.modules():
        if not hasattr(module, "_get_fsdp_state"):
            continue
        found = found if found is not None else []
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        found.extend(getattr(group, "fsdp_params", ()))
    return found


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether any module of `model` is sharded by FSDP2 (`fully_shard`)."""
    return _fsdp2_params(model) is not None


def check_processes(model: torch.nn.Module, executor: str) -> None:
    """Refuse, in one line, the multi-process wrappers a plan cannot run under."""
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__name__ in REFUSED_WRAPPERS:
                raise IntegrationError("model", cls.__name__, REFUSED_WRAPPERS[cls.__name__])
    if executor == "export" and is_fsdp2(model):
        raise IntegrationError("executor", executor, "under FSDP2 only the runtime is tested; use executor='runtime'")


def rank_suffix() -> str:
    """'' in one process, else '.rank{r}of{w}' (the graph's name says whose step it is)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ""
    return f".rank{dist.get_rank()}of{dist.get_world_size()}"


def settle_fsdp2(model: torch.nn.Module, call: Mapping[str, object] | Sequence[object],
                 finish: Callable[[object], torch.Tensor]) -> bool:
    """Run FSDP2's first step plain when it has not run yet (module docstring); whether it ran.
    Every rank reaches its first planned step at the same point, so the collectives pair up."""
    params = _fsdp2_params(model)
    if params is None or all(hasattr(p, "_unsharded_param") for p in params):
        return False
    aside = [(p, p.grad) for p in model.parameters()]
    for p, _ in aside:
        p.grad = None
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        out = model(**call) if isinstance(call, Mapping) else model(*call)
        finish(out).backward()
    for p, grad in aside:
        p.grad = grad
    return True
