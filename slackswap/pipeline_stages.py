"""Pipeline stages under 1F1B and interleaved 1F1B: the order each device runs its micro-batches, how
many it holds, and the activation budget that leaves each micro-batch.

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

Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2; Megatron-LM's `forward_backward_pipelining_
with_interleaving`, megatron/core/pipeline_parallel/schedules.py): the model is split into p x v
chunks (virtual stages) and device d holds chunks d, d + p, ..., d + (v - 1) p, its local chunks
0 .. v - 1. A device runs m x v forward and m x v backward passes. Its k-th forward (k from 0) is
of local chunk (k mod p v) // p and micro-batch (k // p v) p + k mod p: p micro-batches through
chunk 0, the same p through chunk 1, ..., then the next p; its k-th backward is of the same
micro-batch through local chunk v - 1 - (k mod p v) // p, the chunks in reverse. Megatron runs
(p - d - 1) x 2 + (v - 1) x p warm-up forwards (at most m v; all m v when m = p: "all forward passes
and then all backward passes"), then one forward one backward, then the remaining backwards. It
requires m to be a multiple of p ("number of microbatches is not divisible by pipeline-parallel size
when using interleaved schedule"), so every group of p micro-batches fills every chunk. A device
holds a micro-batch *chunk* from the chunk's forward to its backward: at most min(warm-up + 1, m v)
of them (device 0 the most, 2 (p - 1) + (v - 1) p + 1 when m > p), each 1/v of a 1F1B stage's layers.

ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1; the authors'
DeepSpeed schedule `ZeroBubbleH1Pipeline`, sail-sg/zero-bubble-pipeline-parallelism): the backward is
split into B, the input gradient the previous stage waits for, and W, the weight gradient nothing
waits for. Stage i of p runs min(p - i - 1, m) warm-up forwards; then i rounds of F, B with each W
put off (to the end); then F, B, W rounds until its m forwards are done; then B, W rounds; then the i
W it put off, oldest first. Stage 0 defers none (its order is 1F1B's with each backward as B, W), the
last p - 1: the cool-down bubble 1F1B leaves before the last stages' final backwards is filled with
their W. A micro-batch is in flight from its forward until its W ends (W reads the saved inputs of the
linears): at most min(p, m) on every stage, stage 0's 1F1B count, so the peak over stages is 1F1B's
(the paper's condition on ZB-H1), while the later stages hold more than under 1F1B.
"""

from __future__ import annotations

from slackswap.errors import ConfigError

#: The schedules whose per-device order this module gives.
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zb_h1")


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


def zb_h1_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage `stage`'s work in ZB-H1 order (module docstring): ("F", j), ("B", j) input gradient and
    ("W", j) weight gradient of micro-batch j."""
    _check(stage, stages, microbatches)
    m, order = microbatches, []
    f = b = w = 0
    for _ in range(min(stages - stage - 1, m)):  # warm-up forwards, as 1F1B
        order.append(("F", f))
        f += 1
    for _ in range(stage):  # F, B with the W put off
        if f == m:
            break
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    while f < m:  # F, B, W
        order += [("F", f), ("B", b), ("W", w)]
        f, b, w = f + 1, b + 1, w + 1
    while b < m:  # B, W
        order += [("B", b), ("W", w)]
        b, w = b + 1, w + 1
    order += [("W", j) for j in range(w, m)]  # the W put off fill the cool-down
    return order


def check_interleaved(stages: int, virtual_stages: int, microbatches: int) -> None:
    """Megatron-LM's conditions on an interleaved schedule: p >= 2, v >= 2, m a multiple of p."""
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 2:
        raise ConfigError("parallel.virtual_stages", virtual_stages,
                          "must be an integer >= 2 with parallel.pipeline_schedule=interleaved")
    if stages < 2:
        raise ConfigError("parallel.pp", stages, "must be >= 2 with parallel.pipeline_schedule=interleaved")
    if microbatches % stages:
        raise ConfigError("parallel.microbatches", microbatches,
                          f"must be a multiple of parallel.pp={stages} with the interleaved schedule "
                          "(Megatron-LM requires it)")


def interleaved_warmup(device: int, stages: int, virtual_stages: int, microbatches: int) -> int:
    """Megatron-LM's warm-up forwards of device `device` under the interleaved schedule."""
    total = microbatches * virtual_stages
    if microbatches == stages:
        return total
    return min((stages - device - 1) * 2 + (virtual_stages - 1) * stages, total)


def interleaved_order(device: int, stages: int, virtual_stages: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Device `device`'s work in interleaved 1F1B order: (kind, local chunk, micro-batch), kind "F" or "B"."""
    _check(device, stages, microbatches)
    check_interleaved(stages, virtual_stages, microbatches)
    p, v = stages, virtual_stages
    total = microbatches * v

    def op(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k % (p * v)) // p
        return kind, chunk if kind == "F" else v - 1 - chunk, (k // (p * v)) * p + k % p

    warmup = interleaved_warmup(device, p, v, microbatches)
    order = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):  # steady state: forward warmup + k, then backward k
        order += [op("F", warmup + k), op("B", k)]
    order += [op("B", k) for k in range(total - warmup, total)]  # cool-down
    return order


def schedule_order(schedule: str, device: int, stages: int, microbatches: int,
                   virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    """Device `device`'s work under `schedule`: (kind, local chunk, micro-batch); 1F1B's chunk is 0."""
    if schedule == "1f1b":
        if virtual_stages != 1:
            raise ConfigError("parallel.virtual_stages", virtual_stages,
                              "must be 1 unless parallel.pipeline_schedule=interleaved")
        return [(kind, 0, j) for kind, j in one_f_one_b_order(device, stages, microbatches)]
    if schedule == "interleaved":
        return interleaved_order(device, stages, virtual_stages, microbatches)
    if schedule == "zb_h1":
        if virtual_stages != 1:
            raise ConfigError("parallel.virtual_stages", virtual_stages,
                              "must be 1 unless parallel.pipeline_schedule=interleaved")
        return [(kind, 0, j) for kind, j in zb_h1_order(device, stages, microbatches)]
    raise ConfigError("parallel.pipeline_schedule", schedule, f"must be one of {list(SCHEDULES)}")


def in_flight_microbatches(stage: int, stages: int, microbatches: int, schedule: str = "1f1b",
                           virtual_stages: int = 1) -> int:
    """The most micro-batches (interleaved: micro-batch chunks) whose activations device `stage` holds at
    once, counted on its order: from the forward to the backward, under ZB-H1 to the W."""
    order = schedule_order(schedule, stage, stages, microbatches, virtual_stages)
    release = releasing_kind(order)
    held = most = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1 if kind == release else 0
        most = max(most, held)
    return most


def releasing_kind(order: list[tuple[str, int, int]]) -> str:
    """The op after which a micro-batch's activations are gone: "W" in an order that splits the
    backward (ZB-H1), else "B"."""
    return "W" if any(kind == "W" for kind, _, _ in order) else "B"


def stage_budget_bytes(capacity_bytes: int, stage: int, stages: int, microbatches: int, schedule: str = "1f1b",
                       virtual_stages: int = 1) -> int:
    """The activation budget of one micro-batch's (chunk's) step on device `stage`: its capacity / in-flight
    count."""
    if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes < 0:
        raise ConfigError("capacity_bytes", capacity_bytes, "must be an integer >= 0")
    return capacity_bytes // in_flight_microbatches(stage, stages, microbatches, schedule, virtual_stages)
