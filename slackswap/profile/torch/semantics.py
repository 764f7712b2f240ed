"""Which kernels the traced step runs: the target GPU's (`cuda`) or the CPU's (`cpu`), on meta tensors.

Meta tensors follow neither device exactly: a composite op picks its kernel by device type, and the
meta device takes the CPU branch or none at all. Fake CUDA tensors would pick the CUDA branch but abort
under autograd on a CPU build of torch, so instead the tracer routes the few device-dependent
composites itself, at the `torch.nn.functional` level, to the exact aten op the target device's
dispatcher would call. Autograd then saves exactly what that op's derivative formula saves, and the
meta kernel of that op gives the exact output shapes and dtypes. Kernels whose meta implementation
differs from a device's get a size correction after the trace. Every case is in
docs/torch_profile.md (table "ops that differ"); nothing else is adjusted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from slackswap.errors import ConfigError

SEMANTICS: tuple[str, ...] = ("cuda", "cpu")
_HALF = (torch.float16, torch.bfloat16)


def check_semantics(semantics: str) -> str:
    if semantics not in SEMANTICS:
        raise ConfigError("profile.semantics", semantics, f"unknown kernel semantics; known: {SEMANTICS}")
    return semantics


def _sdpa_args(args, kwargs):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return {n: bound.get(n, defaults.get(n)) for n in names}


def cuda_sdpa_backend(q: torch.Tensor, k: torch.Tensor, attn_mask, dropout_p: float) -> str:
    """The backend torch's CUDA `sdp_utils` picks for a dense bf16/fp16 problem on sm80+ (A100/H100/H200):
    flash when there is no explicit mask and the head dim is at most 256 and a multiple of 8, else
    memory-efficient (takes a mask as an additive bias), else math (fp64, odd shapes)."""
    head_dim = q.shape[-1]
    if q.dtype in _HALF and attn_mask is None and head_dim <= 256 and head_dim % 8 == 0 \
            and k.shape[-1] == head_dim:
        return "flash"
    if q.dtype in (*_HALF, torch.float32) and head_dim % 8 == 0:
        return "efficient"
    return "math"


def cpu_sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, dropout_p: float) -> str:
    """The backend torch's CPU `select_sdp_backend_cpp` picks: flash (`_for_cpu`, GQA included) unless a gate
    of `use_flash_attention_cpp` fails (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp at torch 2.13:
    dropout, inputs not 4-D, a zero-length sequence, q/k/v head dims that differ, a last dimension not of
    stride 1, a dtype other than fp32/fp64/bf16/fp16), or the mask requires grad (the flash kernel has no
    gradient for it; read from `torch._fused_sdp_choice` on CPU: BEiT's and Swin's learned relative position
    bias). Then math."""
    tensors = (q, k, v)
    if dropout_p > 0.0 or any(t.dim() != 4 for t in tensors):
        return "math"
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return "math"
    if any(t.shape[-2] == 0 or t.stride(-1) != 1 for t in tensors):
        return "math"
    if q.dtype not in (torch.float32, torch.float64, *_HALF):
        return "math"
    if attn_mask is not None and attn_mask.requires_grad:
        return "math"
    return "flash"


class KernelRouting(TorchFunctionMode):
    """Routes dropout and scaled-dot-product attention to the target device's aten kernels."""

    def __init__(self, semantics: str):
        super().__init__()
        self.semantics = check_semantics(semantics)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout and self.semantics == "cuda":
            return self._cuda_dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._sdpa(func, args, kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _cuda_dropout(input, p=0.5, training=True, inplace=False):
        # CUDA's at::dropout takes the fused kernel (is_fused_kernel_acceptable): native_dropout, whose
        # backward keeps a 1-byte bool mask. The meta device takes the CPU branch (bernoulli noise of the
        # input's dtype, kept by the multiply's backward).
        if not training or p == 0.0 or input.numel() == 0:
            return F.dropout(input, p, training, inplace)
        if inplace:
            raise ConfigError("dropout.inplace", True, "in-place dropout is not traced under cuda semantics")
        return torch.ops.aten.native_dropout(input, p, True)[0]

    def _sdpa(self, func, args, kwargs):
        a = _sdpa_args(args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        if self.semantics == "cpu":
            if cpu_sdpa_backend(q, k, v, a["attn_mask"], a["dropout_p"]) == "math":
                return func(*args, **kwargs)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, a["dropout_p"], a["is_causal"], attn_mask=a["attn_mask"], scale=a["scale"])[0]
        backend = cuda_sdpa_backend(q, k, a["attn_mask"], a["dropout_p"])
        if backend == "flash":  # FlashAttention-2 takes fewer K/V heads (GQA) natively
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, a["dropout_p"], a["is_causal"], False, scale=a["scale"])[0]
        if backend == "math" or k.shape[-3] != q.shape[-3]:  # memory-efficient has no GQA: math
            return func(*args, **kwargs)
        mask = a["attn_mask"]
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        if mask is not None:
            mask = mask.expand(q.shape[0], q.shape[-3], q.shape[-2], k.shape[-2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, a["dropout_p"], a["is_causal"], scale=a["scale"])[0]


def cpu_size_correction(func, output_index: int, tensor: torch.Tensor, args) -> int | None:
    """Bytes a CPU kernel's output really has where the meta kernel differs; None where they agree.

    native_layer_norm: the CPU kernel keeps mean and rstd in the input's dtype when input and weight
    share it (param_scalar_type without mixed types); the meta kernel (and CUDA) use the accumulation
    dtype, fp32 for 16-bit inputs.
    """
    if func is torch.ops.aten.native_layer_norm.default and output_index in (1, 2):
        x, weight = args[0], args[2] if len(args) > 2 else None
        if x.dtype in _HALF and (weight is None or weight.dtype == x.dtype):
            return tensor.numel() * x.element_size()
    return None
