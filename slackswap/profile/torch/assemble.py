"""Turn a `Trace` into the `slackswap.graph.Graph` the planners and the simulator take, timed on a GPU.

One graph tensor per storage created by a recorded op (weight gradients excepted) and version of it:
its consumers are the ops that read it (through any view of it, or, in backward, an unpack of it). An
op that writes a storage in place reads its current version, lists it in `Op.writes` and outputs the
next version, an alias (`Tensor.base`) of the same storage (slackswap.graph's in-place semantics).
Views are not graph tensors at all: they read their storage. Random ops (`Op.random`: dropout, fused
attention with dropout) and the attention core (`Op.attention_core`) are marked. Saved tensors are
attributed to the layer of their first backward reader, as the analytic builder does
(docs/profile.md), so per-layer saved bytes compare one to one.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from slackswap.errors import ConfigError
from slackswap.graph import FORWARD_PHASES, NO_LAYER, Graph, Op, OpClass, Phase, Tensor
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.memory.static import optimizer_step_moved_bytes
from slackswap.profile import default_training, state_bytes_per_param
from slackswap.profile.timing import op_duration_s
from slackswap.profile.torch.fusion import KERNEL_MODES, fused_traffic
from slackswap.profile.torch.tracer import Trace

#: Roles `selective_recompute` treats as the attention core (slackswap.planners.selective_recompute).
QK, PV, SOFTMAX, DROPOUT, CORE, FLASH = "qk_bmm", "pv_bmm", "softmax", "softmax_dropout", "attn_core", "flash_attn"
ATTENTION_CORE_ROLES = frozenset({QK, PV, SOFTMAX, DROPOUT, CORE, FLASH})
_DROPOUT_ATEN = frozenset({"native_dropout", "bernoulli_", "bernoulli", "empty_like", "div_"})
_FUSED_ATTENTION = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
})
_EAGER_ATTENTION = frozenset({"bmm", "baddbmm"})


def traced_attention_kernel(aten: str, configured: str) -> str:
    """The attention kernel (`Hardware.attention_efficiency`) that times a traced attention-class op.

    The model's `attention_kernel`, as the analytic builder uses it, when the trace runs that kind of
    kernel, so both sources of one model price attention alike; otherwise the kind the trace runs:
    eager batched matmuls are `eager`, a fused kernel the preset's generic attention efficiency."""
    if aten.removesuffix("_backward") in _EAGER_ATTENTION:
        return configured if configured in ("", "eager") else "eager"
    return "" if configured == "eager" else configured


def op_name(index: int, phase: Phase, module: str, aten: str) -> str:
    return f"{'fwd' if phase == Phase.FORWARD else phase.value[:4]}{index}:{module}:{aten}"


def forward_roles(trace: Trace) -> dict[int, str]:
    """Attention-core roles per forward op index: within a layer, the ops from a batched matmul to the
    next one (QK^T ... PV) are the eager core; a fused attention kernel is `flash_attn`."""
    roles: dict[int, str] = {}
    by_layer: dict[int, list] = defaultdict(list)
    for op in trace.ops:
        if op.phase == Phase.FORWARD:
            by_layer[op.layer].append(op)
    for layer, ops in by_layer.items():
        if layer == NO_LAYER:
            continue
        bmm = [i for i, op in enumerate(ops) if op.aten in ("bmm", "baddbmm")]
        for first, second in zip(bmm[0::2], bmm[1::2], strict=False):
            roles[ops[first].index], roles[ops[second].index] = QK, PV
            for op in ops[first + 1:second]:
                roles[op.index] = SOFTMAX if "softmax" in op.aten else DROPOUT if op.aten in _DROPOUT_ATEN else CORE
        for op in ops:
            if op.aten in _FUSED_ATTENTION:
                roles[op.index] = FLASH
    return roles


def _held_until(trace: Trace, graph_keys: set[int], names: dict[int, str]) -> dict[str, str]:
    """Tensor name -> the op after which eager execution released its storage, where that is later
    than every op of its own phase that touches the storage (its producer, readers and in-place
    writers): the model's own references (`Tensor.held_until`). For a forward tensor only forward
    touches count: a plan that swaps or recomputes it frees its run copy after its last forward
    reader, unless the model's code still holds it. The hold goes on the storage's last version, whose
    alias chain keeps the earlier versions' storage. A storage alive at the end is held to the last op."""
    if trace.released_after is None or not trace.ops:
        return {}
    backward = {op.index for op in trace.ops if op.phase == Phase.BACKWARD}
    last_touch: dict[int, int] = {}
    for op in trace.ops:
        for k in (*op.reads, *op.creates, *op.writes):
            if k in trace.storages and (op.index in backward) == (trace.storages[k].producer in backward):
                last_touch[k] = op.index
    end = trace.ops[-1].index
    held: dict[str, str] = {}
    for k in graph_keys:
        released = trace.released_after.get(k, end)
        if released > last_touch.get(k, -1):
            held[trace.storages[k].name] = names[released]
    return held


def graph_from_trace(trace: Trace, hardware: Hardware, name: str, meta: dict | None = None, *,
                     training: TrainingConfig | None = None, include_optimizer: bool = False,
                     kernels: str = "eager", attention_kernel: str = "") -> Graph:
    """The traced step as a Graph, each op timed with the roofline of `slackswap.profile.timing`.

    A storage written in place gets one graph tensor per version (module docstring): the op that writes
    it lists the old version in `Op.writes` and outputs the new one (`Tensor.base` = the old version);
    later ops read the newest. The last version carries the storage's identity, earlier ones `@v<i>`.
    `include_optimizer`: end with one optimizer-step op per layer (and one for the rest) streaming the
    bytes of `training`'s recipe for that layer's traced parameters, as the analytic graph does.
    `kernels`: `eager` times every aten call as its own kernel; `fused` times each run of elementwise
    ops as one kernel (`slackswap.profile.torch.fusion`): `Op.moved_bytes` is then the fused traffic.
    `attention_kernel`: the model's (`model.attention_kernel`; `traced_attention_kernel`).
    """
    hardware.peak_for(trace.dtype)
    training = default_training(trace.dtype) if training is None else training
    storages = trace.storages
    graph_keys = {k for k in storages if k not in trace.weight_grads}
    names = {op.index: op_name(op.index, op.phase, op.module, op.aten) for op in trace.ops}
    roles = forward_roles(trace)
    last_version = Counter(k for op in trace.ops for k in op.writes if k in graph_keys)
    version: dict[int, int] = defaultdict(int)
    if kernels not in KERNEL_MODES:
        raise ConfigError("model.torch.kernels", kernels, f"unknown kernel mode; known: {KERNEL_MODES}")
    fused = fused_traffic(trace) if kernels == "fused" else None

    def current(key: int) -> str:
        v = version[key]
        return storages[key].name if v == last_version[key] else f"{storages[key].name}@v{v}"

    # tensor name -> (storage key, producer op index, base tensor name)
    made: dict[str, tuple[int, int, str]] = {}
    consumers: dict[str, list[int]] = defaultdict(list)
    ops: list[Op] = []
    for op in trace.ops:
        inputs = tuple(current(k) for k in op.reads if k in graph_keys)
        for t in inputs:
            consumers[t].append(op.index)
        outputs, writes = [], []
        for k in op.creates:
            if k in graph_keys:
                outputs.append(current(k))
                made[current(k)] = (k, op.index, "")
        for k in op.writes:
            if k in graph_keys:
                old = current(k)
                version[k] += 1
                writes.append(old)
                outputs.append(current(k))
                made[current(k)] = (k, op.index, old)
        moved = op.moved_bytes if fused is None else fused.moved_bytes[op.index]
        duration = op_duration_s(op.flops, moved, op.op_class, trace.dtype, hardware,
                                 attention_kernel=traced_attention_kernel(op.aten, attention_kernel))
        if fused is not None and not fused.launches[op.index]:
            duration -= hardware.launch_overhead_s  # runs inside its group's kernel
        role = roles.get(op.index, op.aten)
        ops.append(Op(names[op.index], op.phase, op.op_class, op.layer, inputs, tuple(outputs), op.flops,
                      moved, duration, "", role, random=op.random, writes=tuple(writes),
                      attention_core=role in ATTENTION_CORE_ROLES))
    if include_optimizer:
        for layer in sorted(trace.layer_params, key=lambda n: (n == NO_LAYER, n)):
            opt = training.optimizer.replace("adamw", "adam")
            moved = optimizer_step_moved_bytes(trace.layer_params[layer], training, trace.dtype)
            ops.append(Op(opt if layer == NO_LAYER else f"L{layer}.{opt}", Phase.OPTIMIZER, OpClass.ELEMENTWISE,
                          layer, (), (), 0.0, moved,
                          op_duration_s(0.0, moved, OpClass.ELEMENTWISE, trace.dtype, hardware), "", "optimizer"))
    op_by_index = {op.index: op for op in trace.ops}
    held_until = _held_until(trace, graph_keys, names)
    tensors: dict[str, Tensor] = {}
    for t_name, (k, producer_index, base) in made.items():
        st = storages[k]
        producer = op_by_index[producer_index]
        readers = [op_by_index[c] for c in consumers[t_name]]
        bwd_layers = [r.layer for r in readers if r.phase == Phase.BACKWARD]
        saved = producer.phase in FORWARD_PHASES and bool(bwd_layers)
        layer = producer.layer
        if saved:
            in_stack = [x for x in bwd_layers if x != NO_LAYER]
            layer = in_stack[0] if in_stack else NO_LAYER
        role = f"{producer.aten}:{st.dtype}" if producer.phase != Phase.BACKWARD else "grad"
        tensors[t_name] = Tensor(t_name, st.size_bytes, names[producer_index],
                                 tuple(names[c] for c in consumers[t_name]), layer, saved, role, base=base,
                                 held_until=held_until.get(t_name, ""))
    state = state_bytes_per_param(trace.dtype)[2]
    info = {"source": "torch", "semantics": trace.semantics, "num_params": trace.num_params,
            "max_unit_params": max(trace.layer_params.values(), default=0),
            "layer_stacks": list(trace.layer_stacks), "hardware": hardware.name}
    return Graph(name, tuple(ops), tensors, trace.num_layers,
                 weight_bytes=trace.param_bytes, weight_grad_bytes=trace.param_bytes,
                 optimizer_state_bytes=state * trace.num_params, meta=info | dict(meta or {}))
