"""The tracer's CPU attention kernel is the one torch's CPU dispatcher picks (`semantics.cpu_sdpa_backend`).

Before, CPU semantics routed every scaled-dot-product attention without dropout to the flash kernel,
whose derivative has no gradient for the mask: BEiT and Swin, whose learned relative position bias is
the mask, crashed the trace (`TraceError: ... not differentiable with respect to argument 'attn_mask'`)
where the real CPU step runs the math kernel.
"""

from __future__ import annotations

import copy
import itertools

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")

nn = torch.nn
F = torch.nn.functional

from slackswap.profile.torch.semantics import cpu_sdpa_backend  # noqa: E402
from slackswap.profile.torch.tracer import trace_step  # noqa: E402
from slackswap.runtime import capture_graph  # noqa: E402
from tests.runtime_support import h200  # noqa: E402

HEADS, SEQ, HEAD_DIM = 2, 8, 8


def test_the_cpu_backend_rule_agrees_with_torchs_own_choice() -> None:
    """Every gate the rule reads, against `torch._fused_sdp_choice` on real CPU tensors (1 is flash)."""
    agree = []
    for rank, kv_width, kv_heads, mask, dropout, dtype, transposed in itertools.product(
            (4, 3), (HEAD_DIM, 4), (HEADS, 1), (None, "fixed", "learned"), (0.0, 0.1),
            (torch.float32, torch.bfloat16, torch.float64), (False, True)):
        shape = (2, HEADS, SEQ, HEAD_DIM)[4 - rank:]
        q = torch.randn(*shape, dtype=dtype)
        if transposed:
            q = torch.randn(*shape[:-2], HEAD_DIM, SEQ, dtype=dtype).transpose(-1, -2)
        kv_shape = (*shape[:-3], kv_heads, SEQ) if rank == 4 else shape[:-1]
        k = torch.randn(*kv_shape, kv_width, dtype=dtype)
        v = torch.randn(*kv_shape, HEAD_DIM, dtype=dtype)
        bias = None if mask is None else torch.randn(SEQ, SEQ, dtype=dtype, requires_grad=mask == "learned")
        gqa = rank == 4 and kv_heads != HEADS
        torch_flash = torch._fused_sdp_choice(q, k, v, bias, dropout, False, enable_gqa=gqa) == 1
        agree.append(torch_flash == (cpu_sdpa_backend(q, k, v, bias, dropout) == "flash"))
    assert all(agree) and len(agree) == 288


class _BiasedAttention(nn.Module):
    """Self-attention with a learned additive bias as the mask (BEiT's and Swin's relative position bias)."""

    def __init__(self, width: int = HEADS * HEAD_DIM) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.bias = nn.Parameter(torch.randn(HEADS, SEQ, SEQ) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], SEQ, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return x + self.out(attended.transpose(1, 2).reshape(x.shape))


def test_a_learned_attention_bias_traces_what_the_cpu_step_saves() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(_BiasedAttention(), _BiasedAttention())
    x = torch.randn(2, SEQ, HEADS * HEAD_DIM)
    loss = lambda out: out.square().mean()  # noqa: E731
    graph = capture_graph(copy.deepcopy(net), (x,), loss, h200(), "biased")
    trace = trace_step(copy.deepcopy(net).to("meta"), (x.to("meta"),), loss, semantics="cpu", dtype="fp32")
    traced = {trace.storages[k].name: trace.storages[k].size_bytes for k in trace.saved}
    assert traced == {t.name: t.size_bytes for t in graph.saved_tensors}
    assert not any("flash" in name for name in traced)  # the math kernel's tensors: scores, softmax
