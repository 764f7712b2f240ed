"""`trl_offload`: TRL's / torchtune's `OffloadActivations` as `get_act_offloading_ctx_manager` sets it
up (huggingface/trl trl/models/activation_offloading.py, copied from torchtune): every saved tensor of
at least `min_offload_size` bytes (1024), except what the output head (`lm_head`, run under a no-op
context) saves; here the head is the last forward op outside the layer stack before the loss.
`use_streams: true` runs the `streamed_fetch_at_unpack` offloader (window `max_fwd_stash_size`),
`use_streams: false` the `save_on_cpu` one (`unpack_tensor_single_stream`: copies on the compute
stream, fetched at unpack); `slackswap.schedule.offloader`. Axolotl's `activation_offloading: true` is
this with streams, replacing gradient checkpointing (axolotl docs/gradient_checkpointing.qmd).
"""

from __future__ import annotations

from slackswap.errors import ConfigError
from slackswap.graph import NO_LAYER, Graph, Phase
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.support.tool_offload import build_for_offloader, pin_option
from slackswap.schedule.offloader import PIN_S_PER_TENSOR, TRL_FWD_STASH_SIZE, get_offloader


def output_head_inputs(graph: Graph) -> frozenset[str]:
    """The tensors the output head saves: the inputs of the last forward op outside the layer stack
    (the loss is a `Phase.LOSS` op, not a forward one)."""
    forward = [op for op in graph.ops if op.phase == Phase.FORWARD]
    last_in_stack = max((i for i, op in enumerate(forward) if op.layer != NO_LAYER), default=-1)
    after = [op for op in forward[last_in_stack + 1:] if op.layer == NO_LAYER]
    return frozenset(after[-1].inputs) if after else frozenset()


@register_planner("trl_offload")
class TrlOffload:
    name = "trl_offload"

    def __init__(self, use_streams: bool = True, max_fwd_stash_size: int = TRL_FWD_STASH_SIZE,
                 min_offload_size: int = 1024, pin_s_per_tensor: float = PIN_S_PER_TENSOR):
        if not isinstance(use_streams, bool):
            raise ConfigError("planner.options.use_streams", use_streams, "must be true or false")
        if not isinstance(max_fwd_stash_size, int) or isinstance(max_fwd_stash_size, bool) or max_fwd_stash_size < 1:
            raise ConfigError("planner.options.max_fwd_stash_size", max_fwd_stash_size, "must be an integer >= 1")
        if not isinstance(min_offload_size, int) or isinstance(min_offload_size, bool) or min_offload_size < 0:
            raise ConfigError("planner.options.min_offload_size", min_offload_size, "must be an integer >= 0")
        pin = pin_option(pin_s_per_tensor)
        self.offloader = (get_offloader("streamed_fetch_at_unpack", offload_window=max_fwd_stash_size,
                                        pin_s_per_tensor=pin)
                          if use_streams else get_offloader("save_on_cpu", pin_s_per_tensor=pin))
        self.min_offload_size = min_offload_size

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        head = output_head_inputs(graph)
        decisions = {
            t.name: Decision.SWAP if t.size_bytes >= max(self.min_offload_size, 1) and t.name not in head
            else Decision.KEEP
            for t in graph.saved_tensors
        }
        return build_for_offloader(graph, decisions, self.offloader, planner=self.name, budget_bytes=budget_bytes,
                                   hardware=hardware, what="offloading every saved tensor but the output head's")
