"""Offloaders: how the tool that runs a plan's copies runs them, so each plan is priced as it would run.

A plan says which tensors are offloaded and prefetched, and after which step each copy is issued.
How the copies then behave depends on the program that makes them, and the offloaders people run
differ from slackswap's own runtime in three ways that cost time:

- **Where the device->host copy runs.** On a side stream the forward pass overlaps it; on the
  compute stream (or with a bounded number of copies in flight) the forward pass waits for it.
- **When the host->device copy is issued.** Look-ahead prefetch hides it behind earlier backward
  steps; "fetch at unpack" issues it when autograd unpacks the tensor for its first backward reader,
  and that reader waits for it.
- **Pinned host memory.** A pool pins once; a pinned allocation per tensor costs host time on every
  offload, and the host thread that launches the compute cannot launch while it pins.

The models (`OFFLOADERS`), each with its source:

- `ideal`: slackswap's runtime (`slackswap.runtime`: one pinned slab for the whole plan, side streams
  per direction, prefetches at the plan's look-ahead positions). The simulator's rules as they were
  before offloaders existed, unchanged (docs/simulation.md section 3).
- `save_on_cpu`: `torch.autograd.graph.save_on_cpu(pin_memory=True)` (torch 2.13,
  torch/autograd/graph.py): the pack hook allocates a pinned host tensor per saved tensor
  (`torch.empty(..., pin_memory=True)`) and copies into it with `copy_(non_blocking=True)` on the
  current, i.e. compute, stream; the unpack hook copies back with `.to(device)` on the compute stream
  when backward unpacks it. So: window 0 (the next step waits for the copy), fetch at unpack with no
  look-ahead, one pinned allocation per offload. Hugging Face's checkpoint offload
  (`PreTrainedModel.activation_checkpointing_enable(offload=True)`, transformers 5.24 modeling_utils.py:
  "Both copies run on the compute stream") runs each layer's checkpoint under this context, and TRL's
  `OffloadActivations(use_streams=False)` does the same on one stream (`unpack_tensor_single_stream`).
- `streamed_fetch_at_unpack`: TRL's / torchtune's `OffloadActivations(use_streams=True)`
  (huggingface/trl trl/models/activation_offloading.py, copied from torchtune): pinned allocation per
  tensor in the pack hook (`torch.empty_like(..., pin_memory=True)`); the device->host copy on a side
  stream after the compute issued so far; before each new offload the compute stream waits for the
  offloads more than `max_fwd_stash_size` (default 5) tensors back (window 5). In backward the unpack
  hook issues the host->device copy on the side stream and makes the compute stream wait for it; that
  side stream was made to wait only for the compute of the autograd node two back, so with the host
  running ahead of the GPU (a launch queue at least one node deep, assumed) the copy overlaps the
  previous node: fetch at unpack with one backward step of look-ahead.

The per-tensor pin cost is a figure, not a mechanism: `PIN_S_PER_TENSOR` = 3 ms, cudaHostAlloc per
tensor measured in pytorch/pytorch PR 186162 (Llama3 8B on 8x H100, 155 offloaded tensors: 3,984
tokens/s without a pinned pool, 6,163 with). Assumption stated: every offload pays it, every step.
PyTorch's CachingHostAllocator can serve a repeated pinned request of the same size from its cache
after the first step, in which case the tools pay much less; the figure is an upper bound for them,
and a plan sets its own (`notes["pin_s_per_tensor"]`, 0 for a tool run with a warm cache).

A plan names its offloader in `notes["offloader"]` (absent: `ideal`), with optional overrides
`notes["offload_window"]` and `notes["pin_s_per_tensor"]`. The simulator reads them
(`offloader_of`); `slackswap.schedule.build` issues prefetches at unpack for the "at_unpack" prefetch
policy. The planners' closed-form replay (`slackswap.schedule.replay`) prices every plan with the
ideal offloader; only the simulator prices the tools.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from slackswap.errors import ConfigError

#: Host seconds one pinned allocation per tensor costs: cudaHostAlloc ~3 ms per tensor, pytorch/pytorch
#: PR 186162 ("Root cause: cudaHostAlloc ~3ms/tensor x 155 tensors = 465ms/step", Llama3 8B, 8x H100).
PIN_S_PER_TENSOR = 3e-3
#: TRL / torchtune `OffloadActivations(max_fwd_stash_size=5)`: the default number of offloads in flight.
TRL_FWD_STASH_SIZE = 5


@dataclass(frozen=True)
class Offloader:
    """How one tool runs a plan's copies (module docstring)."""

    name: str
    #: None: the compute stream never waits for an offload (side stream, pooled buffers). k >= 0: before
    #: a step starts, every offload issued so far except the last k has landed (0: the copy runs on the
    #: compute stream, so the next step waits for it).
    offload_window: int | None
    #: None: prefetches at the plan's positions (look-ahead). k >= 0: the tool issues each prefetch when
    #: the backward step k steps before its first reader finishes, and the reader waits for it.
    fetch_lookahead_steps: int | None
    #: Host seconds each offload costs before its copy can start, on the compute stream's timeline
    #: (the host thread that pins cannot launch compute meanwhile).
    pin_s_per_tensor: float
    source: str

    @property
    def is_ideal(self) -> bool:
        return self.offload_window is None and self.pin_s_per_tensor == 0.0

    def notes(self) -> dict[str, object]:
        """The plan notes that select this offloader (what a planner writes)."""
        return {"offloader": self.name, "offload_window": self.offload_window,
                "pin_s_per_tensor": self.pin_s_per_tensor}


OFFLOADERS: dict[str, Offloader] = {
    o.name: o for o in (
        Offloader("ideal", None, None, 0.0, "slackswap runtime: pooled pinned slab, side streams, look-ahead"),
        Offloader("save_on_cpu", 0, 0, PIN_S_PER_TENSOR,
                  "torch.autograd.graph.save_on_cpu(pin_memory=True); "
                  "HF activation_checkpointing_enable(offload=True)"),
        Offloader("streamed_fetch_at_unpack", TRL_FWD_STASH_SIZE, 1, PIN_S_PER_TENSOR,
                  "TRL/torchtune OffloadActivations(use_streams=True, max_fwd_stash_size=5)"),
    )
}


def get_offloader(name: str, *, offload_window: int | None = None, pin_s_per_tensor: float | None = None,
                  field: str = "offloader") -> Offloader:
    """The offloader `name`, with the window and pin cost overridden where given; a bad value is a
    ConfigError naming `field`."""
    if name not in OFFLOADERS:
        raise ConfigError(field, name, f"unknown offloader; known: {', '.join(OFFLOADERS)}")
    base = OFFLOADERS[name]
    if offload_window is not None:
        if base.offload_window is None:
            raise ConfigError("offload_window", offload_window, f"offloader {name!r} has no offload window")
        if not isinstance(offload_window, int) or isinstance(offload_window, bool) or offload_window < 0:
            raise ConfigError("offload_window", offload_window, "must be an integer >= 0")
        base = replace(base, offload_window=offload_window)
    if pin_s_per_tensor is not None:
        if (not isinstance(pin_s_per_tensor, (int, float)) or isinstance(pin_s_per_tensor, bool)
                or not math.isfinite(pin_s_per_tensor) or pin_s_per_tensor < 0):
            raise ConfigError("pin_s_per_tensor", pin_s_per_tensor, "must be a non-negative finite number")
        if base.name == "ideal" and pin_s_per_tensor:
            raise ConfigError("pin_s_per_tensor", pin_s_per_tensor, "the ideal offloader pools its pinned "
                              "memory (a node's pin cost is node.pin_setup_s_per_tensor)")
        base = replace(base, pin_s_per_tensor=float(pin_s_per_tensor))
    return base


def offloader_of(notes: Mapping[str, object]) -> Offloader:
    """The offloader a plan's notes name (`ideal` when they name none)."""
    name = notes.get("offloader", "ideal")
    window = notes.get("offload_window")
    pin = notes.get("pin_s_per_tensor")
    return get_offloader(str(name), offload_window=window, pin_s_per_tensor=pin,  # type: ignore[arg-type]
                         field="plan.notes.offloader")
