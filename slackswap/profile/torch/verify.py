"""Check a trace against a real run: the same step run on a device, its saved tensors measured by hooks.

`compare_saved(model, spec, device)` traces the step on meta tensors with the kernel semantics of
`device` ("cpu" or "cuda"), runs it for real on `device` (random weights, the same example inputs),
and compares the saved tensors identity by identity (docs/torch_profile.md). The tests run it on the
CPU; `python -m pipelines.verify_torch ... device=cuda` runs it on a GPU (not yet run on one: no GPU
was available when this was written).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slackswap.model_config import ModelConfig
from slackswap.profile.torch.spec import TorchSpec


@dataclass(frozen=True)
class SavedComparison:
    device: str
    semantics: str
    traced: dict[str, int]
    real: dict[str, int]

    @property
    def differing(self) -> dict[str, tuple[int | None, int | None]]:
        """identity -> (traced bytes, real bytes) where they differ (None: absent on that side)."""
        names = sorted(self.traced.keys() | self.real.keys())
        return {n: (self.traced.get(n), self.real.get(n)) for n in names if self.traced.get(n) != self.real.get(n)}

    @property
    def equal(self) -> bool:
        return not self.differing

    def summary(self) -> str:
        lines = [f"{self.device} ({self.semantics} semantics): traced {sum(self.traced.values())} B in "
                 f"{len(self.traced)} tensors, real {sum(self.real.values())} B in {len(self.real)} tensors: "
                 + ("EQUAL" if self.equal else f"{len(self.differing)} differ")]
        lines += [f"  {name}: traced {t} real {r}" for name, (t, r) in self.differing.items()]
        return "\n".join(lines)


def compare_saved(model: ModelConfig, spec: TorchSpec, device: str, seed: int = 0) -> SavedComparison:
    import torch

    from slackswap.profile.torch import trace_model
    from slackswap.profile.torch.measure import measure_saved
    from slackswap.profile.torch.workloads import build_workload

    semantics = torch.device(device).type
    spec = replace(spec, semantics=semantics)
    trace, _ = trace_model(model, spec)
    traced = {trace.storages[k].name: trace.storages[k].size_bytes for k in trace.saved}
    torch.manual_seed(seed)
    net, inputs, loss_fn = build_workload(model, spec, device)
    real = measure_saved(net, inputs, loss_fn)
    return SavedComparison(device, semantics, traced, real)
