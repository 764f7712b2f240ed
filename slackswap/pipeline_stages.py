"""Pipeline stages under 1F1B: the order each stage runs its micro-batches, how many it holds, and the
activation budget that leaves each micro-batch.

1F1B (PipeDream-Flush; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2.1; Megatron-LM's `forward_backward_pipelining_without_
interleaving`): stage i of p (0 first) runs min(p - i - 1, m) warm-up forwards, then alternates one
forward and one backward until its m forwards are done, then runs the remaining backwards. A
micro-batch is *in flight* on a stage from its forward until its backward ends: its saved activations
stay there. The most in flight at once is min(p - i, m): the first stage holds p, the last one 1.

The budget scaling: a stage that holds k micro-batches gives each micro-batch's step capacity / k.
It is sound: a plan whose step peaks at P <= capacity / k keeps at most P of saved activations on the
device between its forward and its backward, so k - 1 resident micro-batches plus the running one
stay within k * capacity / k. It is conservative by the running step's transients, which only one
micro-batch has at a time. The simulator's pipeline step (stages, bubbles, p2p sends) is not here.
"""

from __future__ import annotations

from slackswap.errors import ConfigError


def _check(stage: int, stages: int, microbatches: int) -> None:
    for name, value, low in (("parallel.pp", stages, 1), ("microbatches", microbatches, 1), ("stage", stage, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(name, value, f"must be an integer >= {low}")
    if stage >= stages:
        raise ConfigError("stage", stage, f"must be below parallel.pp={stages}")


def one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage `stage`'s work in 1F1B order: ("F", j) forward and ("B", j) backward of micro-batch j."""
    _check(stage, stages, microbatches)
    warmup = min(stages - stage - 1, microbatches)
    order = [("F", j) for j in range(warmup)]
    backward = 0
    for j in range(warmup, microbatches):  # steady state: one forward, one backward
        order += [("F", j), ("B", backward)]
        backward += 1
    order += [("B", j) for j in range(backward, microbatches)]  # cool-down
    return order


def in_flight_microbatches(stage: int, stages: int, microbatches: int) -> int:
    """The most micro-batches whose activations stage `stage` holds at once, counted on its 1F1B order."""
    held = most = 0
    for kind, _ in one_f_one_b_order(stage, stages, microbatches):
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def stage_budget_bytes(capacity_bytes: int, stage: int, stages: int, microbatches: int) -> int:
    """The activation budget of one micro-batch's step on stage `stage`: its capacity / in-flight count."""
    if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes < 0:
        raise ConfigError("capacity_bytes", capacity_bytes, "must be an integer >= 0")
    return capacity_bytes // in_flight_microbatches(stage, stages, microbatches)
