"""Closed forms from Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), section 4.1 and appendix: the analytic anchor the profile is tested against.

They hold for one BERT/GPT-2 transformer layer with 16-bit activations, dropout on, a 4h MLP and
attention that materialises the s x s scores (no fused kernel).
"""

from __future__ import annotations

from slackswap.errors import ConfigError


def _check(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(name, value, "must be a positive integer")


def korthikanti_saved_bytes_per_layer(seq_len: int, micro_batch_size: int, hidden_size: int, num_heads: int) -> int:
    """s*b*h*(34 + 5*a*s/h) bytes = 34*s*b*h + 5*a*s^2*b (integer form, exact to the byte)."""
    _check(seq_len=seq_len, micro_batch_size=micro_batch_size, hidden_size=hidden_size, num_heads=num_heads)
    s, b, h, a = seq_len, micro_batch_size, hidden_size, num_heads
    return 34 * s * b * h + 5 * a * s * s * b


def korthikanti_fwd_flops_per_layer(seq_len: int, micro_batch_size: int, hidden_size: int) -> int:
    """24*b*s*h^2 + 4*b*s^2*h matrix-multiply FLOPs (QKV, projection, 4h MLP, and the two attention bmms)."""
    _check(seq_len=seq_len, micro_batch_size=micro_batch_size, hidden_size=hidden_size)
    s, b, h = seq_len, micro_batch_size, hidden_size
    return 24 * b * s * h * h + 4 * b * s * s * h


def korthikanti_bwd_flops_per_layer(seq_len: int, micro_batch_size: int, hidden_size: int) -> int:
    """Backward = 2x forward: every matmul has a data-gradient and a weight-gradient GEMM."""
    return 2 * korthikanti_fwd_flops_per_layer(seq_len, micro_batch_size, hidden_size)


def _check_tp(num_heads: int, tensor_parallel: int) -> None:
    _check(tensor_parallel=tensor_parallel)
    if num_heads % tensor_parallel:
        raise ConfigError("tensor_parallel", tensor_parallel, f"does not divide num_heads={num_heads}")


def korthikanti_saved_bytes_per_layer_tp(
    seq_len: int, micro_batch_size: int, hidden_size: int, num_heads: int, tensor_parallel: int
) -> int:
    """Tensor parallelism alone (Korthikanti et al. 2022, section 4.2.1, Table 2): s*b*h*(10 + 24/t + 5*a*s/(h*t)).

    The 10 sbh stay whole on every rank: the two LayerNorm inputs (2 + 2), the QKV and MLP inputs
    (2 + 2) and the two dropout masks (1 + 1). The 24 sbh (Q, K, V 6; projection input 2; GeLU input
    8; second-linear input 8) and the 5as^2b of attention are split over the t ranks. Integer form:
    10sbh + 24sbh/t + 5as^2b/t, exact when t divides a (h = a * head_dim, so t divides h too).
    """
    _check(seq_len=seq_len, micro_batch_size=micro_batch_size, hidden_size=hidden_size, num_heads=num_heads)
    _check_tp(num_heads, tensor_parallel)
    s, b, h, a, t = seq_len, micro_batch_size, hidden_size, num_heads, tensor_parallel
    return 10 * s * b * h + 24 * s * b * h // t + 5 * a * s * s * b // t


def korthikanti_saved_bytes_per_layer_tp_sp(
    seq_len: int, micro_batch_size: int, hidden_size: int, num_heads: int, tensor_parallel: int
) -> int:
    """Tensor plus sequence parallelism (Korthikanti et al. 2022, section 4.2.2, Table 2):
    s*b*h/t*(34 + 5*a*s/h): the 10 sbh of the LayerNorm/dropout region are split along the sequence
    too. Integer form (34sbh + 5as^2b)/t."""
    _check(seq_len=seq_len, micro_batch_size=micro_batch_size, hidden_size=hidden_size, num_heads=num_heads)
    _check_tp(num_heads, tensor_parallel)
    s, b, h, a, t = seq_len, micro_batch_size, hidden_size, num_heads, tensor_parallel
    return 34 * s * b * h // t + 5 * a * s * s * b // t


def llama_flash_saved_bytes_per_layer(
    seq_len: int, micro_batch_size: int, hidden_size: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int,
    *, tensor_parallel: int = 1, sequence_parallel: bool = False, context_parallel: int = 1,
    fp8_linear_inputs: bool = False,
) -> int:
    """Korthikanti's per-layer accounting applied to a Llama layer (RMSNorm, rotary, GQA, fused flash
    attention, SwiGLU, no dropout) with 2-byte activations, for one rank of tp x cp (sp: with tp).

    With s' = s / cp tokens per rank and kv = num_kv_heads * head_dim:
    - whole on every tp rank (split by t only under sp): the two RMSNorm inputs, the QKV input and the
      gate/up input, 4 x 2s'bh;
    - split by t: rotated Q (2s'bh), rotated K and V (2 x 2s'b*kv), the flash output (2s'bh, the
      projection's input too), gate and up outputs and the SwiGLU output (3 x 2s'bf), and the fp32
      log-sum-exp (4 b a s').
    With FP8 linear inputs (Transformer Engine) the QKV, gate/up and down inputs are 1 byte each, and
    the projection keeps a 1-byte copy beside flash's own 2-byte output (s'bh/t more).
    """
    _check(seq_len=seq_len, micro_batch_size=micro_batch_size, hidden_size=hidden_size, num_heads=num_heads,
           num_kv_heads=num_kv_heads, ffn_hidden_size=ffn_hidden_size, context_parallel=context_parallel)
    _check_tp(num_kv_heads, tensor_parallel)
    t, s, b, h, a, f = tensor_parallel, seq_len // context_parallel, micro_batch_size, hidden_size, num_heads, \
        ffn_hidden_size
    kv = num_kv_heads * (h // a)
    shards = t if sequence_parallel else 1
    linear_in = 1 if fp8_linear_inputs else 2  # bytes per element of a saved linear input
    whole = (2 * 2 + 2 * linear_in) * s * b * h // shards  # two norm inputs; QKV and gate/up inputs
    split = (2 * s * b * h + 4 * s * b * kv + 2 * s * b * h + 4 * s * b * f) // t + 4 * b * a * s // t
    split += linear_in * s * b * f // t  # the down projection's input (the SwiGLU output)
    if fp8_linear_inputs:
        split += s * b * h // t  # the projection's 1-byte copy of the flash output
    return whole + split
