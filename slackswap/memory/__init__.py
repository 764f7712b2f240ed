"""Memory the way a GPU sees it: static training state per GPU, device capacity, the caching allocator.

- `training`: the training recipe (optimizer, precision, gradient buffers, ZeRO sharding).
- `static`: bytes of weights, gradients and optimizer state per GPU, each term cited; the device
  capacity left for activations, and the sharding degree that would make a model fit.
- `caching_allocator`: a model of PyTorch's CUDA caching allocator (rounding, pools, best fit,
  splitting, segments never moved or released while in use).
- `replay`: the allocation sequence of one simulated step, replayed through that allocator.

docs/memory.md states every rule and its source.
"""
