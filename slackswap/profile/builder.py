"""Graph builder: record the forward pass op by op, then derive the backward pass like autograd does.

Family modules (`layers.py`) only describe the forward pass: each forward op names the forward
tensors its backward needs (`bwd_reads`) and its backward FLOPs. `GraphBuilder.finish` then walks the
forward ops in reverse and emits one backward op per forward op, with activation gradients as graph
tensors:

- the gradient of a tensor is produced by the first backward op that contributes to it; every later
  contributor lists it as an input (it accumulates in place); the backward op of the tensor's forward
  producer reads it last. This is the rule in the `slackswap.graph` docstring, and falls out of the
  reverse walk for free.
- a tensor is `saved` when a backward op reads it, and is attributed (`Tensor.layer`) to the
  transformer layer of the first backward op that reads it, so per-layer saved bytes are the bytes
  that layer's backward needs (the Korthikanti accounting).

Every op is timed here, with `op_duration_s`, so the graph comes out complete.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.errors import SlackSwapError
from slackswap.graph import FORWARD_PHASES, NO_LAYER, Graph, Op, OpClass, Phase, Tensor
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.memory.static import optimizer_step_moved_bytes
from slackswap.profile.timing import op_duration_s


@dataclass
class _TensorRec:
    size_bytes: int
    producer: str
    role: str
    differentiable: bool
    consumers: list[str]


@dataclass(frozen=True)
class _ForwardRec:
    name: str
    op_class: OpClass
    layer: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    role: str
    bwd_reads: tuple[str, ...]
    bwd_flops: float
    bwd_extra_bytes: int


def grad_name(tensor: str) -> str:
    return f"grad:{tensor}"


class GraphBuilder:
    """Accumulates forward ops and tensors for one graph; `finish` adds backward/optimizer ops and times all."""

    def __init__(self, hardware: Hardware, dtype: str, attention_kernel: str = ""):
        self.hardware = hardware
        self.dtype = dtype
        self.attention_kernel = attention_kernel  # times the attention-class ops (op_duration_s)
        self._tensors: dict[str, _TensorRec] = {}
        self._ops: list[tuple] = []  # Op constructor arguments, in execution order
        self._forward: list[_ForwardRec] = []
        self._flags: dict[str, dict[str, bool]] = {}  # forward op -> Op keyword flags (random, attention_core)

    # -- forward -----------------------------------------------------------------------------------

    def tensor(self, name: str, size_bytes: int, role: str, *, differentiable: bool = True) -> str:
        """Declare an output tensor of the next forward op."""
        if name in self._tensors:
            raise SlackSwapError(f"profile: tensor {name!r} declared twice")
        self._tensors[name] = _TensorRec(int(size_bytes), "", role, differentiable, [])
        return name

    def size(self, name: str) -> int:
        return self._tensors[name].size_bytes

    def forward(
        self,
        name: str,
        op_class: OpClass,
        layer: int,
        inputs: tuple[str, ...],
        outputs: tuple[str, ...],
        *,
        role: str,
        flops: float = 0.0,
        extra_bytes: int = 0,
        bwd_reads: tuple[str, ...] = (),
        bwd_flops: float = 0.0,
        bwd_extra_bytes: int = 0,
        phase: Phase = Phase.FORWARD,
        random: bool = False,
        attention_core: bool = False,
    ) -> None:
        """Record a forward op. `extra_bytes` is HBM traffic of non-graph data (weights, parameters);
        `random` and `attention_core` are the Op flags of the same name (slackswap/graph.py)."""
        self._flags[name] = {"random": random, "attention_core": attention_core}
        for t in outputs:
            self._tensors[t].producer = name
        for t in bwd_reads:
            if t not in self._tensors:
                raise SlackSwapError(f"profile: op {name!r} backward reads unknown tensor {t!r}")
        self._append(name, phase, op_class, layer, inputs, outputs, flops, extra_bytes, "", role)
        self._forward.append(
            _ForwardRec(name, op_class, layer, inputs, outputs, role, bwd_reads, bwd_flops, bwd_extra_bytes)
        )

    # -- backward, optimizer, assembly -------------------------------------------------------------

    def backward(self) -> None:
        """Emit one backward op per forward op, in reverse order (see the module docstring)."""
        grads: dict[str, str] = {}
        for rec in reversed(self._forward):
            missing = [t for t in rec.outputs if self._tensors[t].differentiable and t not in grads]
            if missing:
                raise SlackSwapError(f"profile: op {rec.name!r} output(s) {missing} receive no gradient")
            grad_outs = tuple(grads[t] for t in rec.outputs if self._tensors[t].differentiable)
            inputs = list(rec.bwd_reads) + list(grad_outs)
            outputs: list[str] = []
            accumulated: list[str] = []
            for t in rec.inputs:
                if not self._tensors[t].differentiable:
                    continue
                if t in grads:
                    inputs.append(grads[t])
                    accumulated.append(grads[t])
                else:
                    g = self.tensor(grad_name(t), self._tensors[t].size_bytes, "grad")
                    grads[t] = g
                    outputs.append(g)
            name = f"{rec.name}.bwd"
            for g in outputs:
                self._tensors[g].producer = name
            # An accumulated gradient is read and written back: count its bytes twice.
            extra = rec.bwd_extra_bytes + sum(self._tensors[g].size_bytes for g in accumulated)
            self._append(name, Phase.BACKWARD, rec.op_class, rec.layer, tuple(inputs), tuple(outputs),
                         rec.bwd_flops, extra, rec.name, f"{rec.role}_bwd")

    def optimizer(self, name: str, layer: int, moved_bytes: int) -> None:
        """An optimizer-step op: no activation tensors, HBM-bound on the optimizer state it streams."""
        self._append(name, Phase.OPTIMIZER, OpClass.ELEMENTWISE, layer, (), (), 0.0, moved_bytes, "",
                     "optimizer")

    def _append(self, name, phase, op_class, layer, inputs, outputs, flops, extra_bytes, forward_op, role):
        for t in inputs:
            if t not in self._tensors:
                raise SlackSwapError(f"profile: op {name!r} reads undeclared tensor {t!r}")
            self._tensors[t].consumers.append(name)
        self._ops.append((name, phase, op_class, layer, tuple(inputs), tuple(outputs), float(flops),
                          int(extra_bytes), forward_op, role))

    def finish(self, name: str, num_layers: int, *, weight_bytes: int, weight_grad_bytes: int,
               optimizer_state_bytes: int, meta: dict) -> Graph:
        tensors = self._tensors
        op_phase = {op[0]: op[1] for op in self._ops}
        op_layer = {op[0]: op[3] for op in self._ops}
        ops = []
        for (op_name, phase, op_class, layer, inputs, outputs, flops, extra, forward_op, role) in self._ops:
            moved = extra + sum(tensors[t].size_bytes for t in inputs) + sum(tensors[t].size_bytes for t in outputs)
            duration = op_duration_s(flops, moved, op_class, self.dtype, self.hardware,
                                     attention_kernel=self.attention_kernel)
            ops.append(Op(op_name, phase, op_class, layer, inputs, outputs, flops, moved, duration, forward_op, role,
                          **self._flags.get(op_name, {})))
        out: dict[str, Tensor] = {}
        for t_name, rec in tensors.items():
            bwd_readers = [c for c in rec.consumers if op_phase[c] == Phase.BACKWARD]
            saved = op_phase[rec.producer] in FORWARD_PHASES and bool(bwd_readers)
            layer = op_layer[rec.producer]
            if saved:
                in_stack = [op_layer[c] for c in bwd_readers if op_layer[c] != NO_LAYER]
                layer = in_stack[0] if in_stack else NO_LAYER
            out[t_name] = Tensor(t_name, rec.size_bytes, rec.producer, tuple(rec.consumers), layer, saved, rec.role)
        return Graph(name, tuple(ops), out, num_layers, weight_bytes=weight_bytes,
                     weight_grad_bytes=weight_grad_bytes, optimizer_state_bytes=optimizer_state_bytes, meta=meta)


def add_optimizer_steps(gb: GraphBuilder, layer_params: dict[int, int], training: TrainingConfig, dtype: str) -> None:
    """One optimizer update op per parameter group (each layer, then the embeddings + head), moving the
    bytes `training`'s optimizer reads and writes: the whole model's graph and a pipeline stage's alike."""
    for layer in sorted(layer_params, key=lambda n: (n == NO_LAYER, n)):
        name = "adam" if layer == NO_LAYER else f"L{layer}.adam"
        if training.optimizer != "adamw":
            name = name.replace("adam", training.optimizer)
        gb.optimizer(name, layer, optimizer_step_moved_bytes(layer_params[layer], training, dtype))
