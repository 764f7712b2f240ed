"""Run one training step for real on a device and measure what autograd saves (the tracer's ground truth).

`measure_saved(model, inputs, loss_fn)` runs forward, loss and backward on whatever device the model
lives on (CPU in the tests, CUDA in `python -m slackswap.profile.torch.verify`), with a
`saved_tensors_hooks` pack hook recording every saved tensor's storage once, named with the same
identities the tracer gives its graph tensors (slackswap.profile.torch.identity). Parameters,
buffers and user inputs are not activations and are left out, as in the traced graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from slackswap.profile.torch.identity import StorageIdentities, storage_key


def measure_saved(
    model: torch.nn.Module, inputs: Sequence[object], loss_fn: Callable[[object], torch.Tensor]
) -> dict[str, int]:
    """identity -> storage bytes of every activation storage autograd saved in forward and loss."""
    saved: dict[int, tuple[str, int]] = {}
    keep: list[torch.Tensor] = []
    ids = StorageIdentities(model)

    def pack(t: torch.Tensor) -> torch.Tensor:
        ident = ids.identity(t)
        if ident:  # created under the mode in forward/loss: an activation, not a parameter or input
            saved.setdefault(storage_key(t), (ident, t.untyped_storage().nbytes()))
            keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ids:
        output = model(*inputs)
        ids.enter_loss()
        loss = loss_fn(output)
        ids.stop_identities()
        keep.clear()
        loss.backward()
    return dict(saved.values())
