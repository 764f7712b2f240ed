"""Tokens per second and model FLOPs utilisation (MFU) of a simulated step.

MFU follows the definition of Chowdhery et al. 2022 (PaLM, arXiv:2204.02311, appendix B): the FLOPs
the model needs per step, divided by the step time and the device's peak FLOP/s. Recomputation is not
counted (it is work a plan adds, not work the model needs; the same paper's "hardware FLOPs
utilisation" would count it). The model FLOPs here are the graph's own: the summed `flops` of every
forward, loss and backward op of the keep-all graph (a plan recomputes by re-running forward ops, so
no recompute is in the graph; the optimizer step is left out as in both papers). For a GPT-shaped
analytic graph that sum equals Korthikanti et al. 2022 (arXiv:2205.05198, section 6)'s model FLOPs
per iteration, 72 B s l h^2 (1 + s/(6h) + V/(12 h l)), which `tests/test_experiment.py` checks; for a
traced graph it is what the tracer's FLOP counter assigns each op.

Per GPU: each GPU of a data-parallel (ZeRO) job runs one micro-batch per step, so tokens/s is one
GPU's `micro_batch_size x seq_len / step_s`.
"""

from __future__ import annotations

from slackswap.graph import Graph, Phase
from slackswap.hardware import Hardware

#: The phases whose FLOPs are the model's (the optimizer step is not).
MODEL_PHASES: frozenset[Phase] = frozenset({Phase.FORWARD, Phase.LOSS, Phase.BACKWARD})

#: Where `model_flops` comes from, stated in metrics.json and the printed summary.
FLOPS_SOURCE = "graph forward+loss+backward op FLOPs, recompute and optimizer excluded (PaLM appendix B MFU)"


def model_flops(graph: Graph) -> float:
    """FLOPs the model needs for one step: forward, loss and backward ops of the graph."""
    return float(sum(op.flops for op in graph.ops if op.phase in MODEL_PHASES))


def tokens_per_s(tokens_per_step: int, step_s: float | None) -> float | None:
    """One GPU's tokens per second; None when the step has no time (no plan, or infeasible)."""
    if step_s is None or step_s <= 0:
        return None
    return tokens_per_step / step_s


def mfu(flops: float, step_s: float | None, hardware: Hardware, dtype: str) -> float | None:
    """Model FLOPs utilisation: `flops / (step_s x peak FLOP/s of dtype)`; None without a step time."""
    if step_s is None or step_s <= 0:
        return None
    return flops / (step_s * hardware.peak_for(dtype))
