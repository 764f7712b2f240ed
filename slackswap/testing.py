"""Small hand-made graphs, toy hardware, and random graphs + random valid plans, for tests.

Used by the simulator's own tests and reusable by other stages' tests. Nothing here imports pytest
or hypothesis: the random generators take a `random.Random`, so a hypothesis test can pass
`st.randoms(use_true_random=False)` and still shrink.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slackswap.graph import FORWARD_PHASES, Graph, Op, OpClass, Phase, Tensor
from slackswap.hardware import Hardware, HostLink
from slackswap.plan import ComputeStep, Decision, Direction, Plan, StepKind, Transfer


@dataclass(frozen=True)
class OpSpec:
    name: str
    phase: Phase
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    duration_s: float
    layer: int = 0
    random: bool = False
    writes: tuple[str, ...] = ()


def fwd(name: str, inputs: Sequence[str], outputs: Sequence[str], duration_s: float, layer: int = 0) -> OpSpec:
    return OpSpec(name, Phase.FORWARD, tuple(inputs), tuple(outputs), duration_s, layer)


def bwd(name: str, inputs: Sequence[str], outputs: Sequence[str], duration_s: float, layer: int = 0) -> OpSpec:
    return OpSpec(name, Phase.BACKWARD, tuple(inputs), tuple(outputs), duration_s, layer)


def make_graph(
    specs: Sequence[OpSpec], sizes: Mapping[str, int], name: str = "toy", bases: Mapping[str, str] | None = None,
    held_until: Mapping[str, str] | None = None,
) -> Graph:
    """Build a Graph from ops in execution order; consumers and `saved` (read by a backward op) are derived.
    `bases` maps an alias tensor to the tensor whose storage it shares; `held_until` a tensor to the op
    after which the model's code drops it (`Tensor.held_until`)."""
    bases = bases or {}
    held_until = held_until or {}
    producer: dict[str, str] = {}
    consumers: dict[str, list[str]] = {}
    phase_of = {s.name: s.phase for s in specs}
    layer_of: dict[str, int] = {}
    for s in specs:
        for t in s.inputs:
            consumers.setdefault(t, []).append(s.name)
        for t in s.outputs:
            producer[t] = s.name
            layer_of[t] = s.layer
    tensors = {
        t: Tensor(
            name=t,
            size_bytes=sizes[t],
            producer=producer[t],
            consumers=tuple(consumers.get(t, ())),
            layer=layer_of[t],
            saved=any(phase_of[c] == Phase.BACKWARD for c in consumers.get(t, ())),
            base=bases.get(t, ""),
            held_until=held_until.get(t, ""),
        )
        for t in producer
    }
    ops = tuple(
        Op(
            name=s.name,
            phase=s.phase,
            op_class=OpClass.MATMUL,
            layer=s.layer,
            inputs=s.inputs,
            outputs=s.outputs,
            flops=0.0,
            moved_bytes=0,
            duration_s=s.duration_s,
            random=s.random,
            writes=s.writes,
        )
        for s in specs
    )
    return Graph(name=name, ops=ops, tensors=tensors, num_layers=1 + max((s.layer for s in specs), default=0))


def toy_hardware(
    d2h_bytes_per_s: float = 100.0,
    h2d_bytes_per_s: float = 100.0,
    latency_s: float = 0.0,
    d2h_engines: int = 1,
    h2d_engines: int = 1,
) -> Hardware:
    """Hardware whose only relevant part is the link (op durations live in the graph)."""
    return Hardware(
        name="toy",
        peak_flops_per_s={"bf16": 1e12},
        hbm_bytes_per_s=1e12,
        device_memory_bytes=1 << 40,
        link=HostLink(
            name="toy-link",
            d2h_theoretical_bytes_per_s=d2h_bytes_per_s,
            h2d_theoretical_bytes_per_s=h2d_bytes_per_s,
            d2h_effective_bytes_per_s=d2h_bytes_per_s,
            h2d_effective_bytes_per_s=h2d_bytes_per_s,
            latency_s=latency_s,
            d2h_engines=d2h_engines,
            h2d_engines=h2d_engines,
        ),
        efficiency={"matmul": 1.0, "attention": 1.0, "elementwise": 1.0},
        hbm_efficiency=1.0,
        launch_overhead_s=0.0,
    )


def random_graph(
    rng: random.Random, max_layers: int = 4, max_size_bytes: int = 1000, real_program: bool = False,
    in_place: bool = False, held: bool = False,
) -> Graph:
    """A layered forward chain with side tensors, a loss, and a mirrored backward pass.

    Forward op i reads the previous layer output and sometimes an older tensor; it produces a main
    output and sometimes a side tensor (a mask-like tensor only backward reads). Backward op i reads
    the incoming gradient and a random non-empty subset of forward op i's inputs and outputs.
    With `real_program`, an op with a side tensor is sometimes random (dropout-like), and a layer's
    main output is sometimes a view of its input (it aliases the previous main output's storage).
    With `in_place` as well, a layer's op sometimes overwrites its input in place (a ReLU_-like op:
    its main output is the new version of the previous main output, whose old version nobody reads
    afterwards). With `held`, some forward tensors are held by the model's code (`Tensor.held_until`)
    until a random later op.
    """
    n = rng.randint(1, max_layers)
    specs: list[OpSpec] = []
    sizes: dict[str, int] = {}
    bases: dict[str, str] = {}

    def dur() -> float:
        return rng.choice([0.25, 0.5, 1.0, 1.5, 2.0, 3.0])

    def size() -> int:
        return rng.randint(0, max_size_bytes) if rng.random() < 0.1 else rng.randint(1, max_size_bytes)

    sizes["x"] = size()
    specs.append(fwd("embed", (), ("x",), dur()))
    prev = "x"
    fwd_io: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    produced = ["x"]
    overwritten: set[str] = set()
    for i in range(n):
        ins = [prev]
        if len(produced) > 1 and rng.random() < 0.3:
            older = rng.choice(produced[:-1])
            if older not in ins:
                ins.append(older)
        outs = [f"h{i}"]
        if rng.random() < 0.5:
            outs.append(f"m{i}")
        for t in outs:
            sizes[t] = size()
        is_random = real_program and len(outs) > 1 and rng.random() < 0.5
        if real_program and rng.random() < 0.3:
            bases[outs[0]] = prev
        writes: tuple[str, ...] = ()
        if real_program and in_place and not is_random and rng.random() < 0.3:
            bases[outs[0]] = prev
            writes = (prev,)
            overwritten.add(prev)
            produced.remove(prev)
        specs.append(OpSpec(f"f{i}", Phase.FORWARD, tuple(ins), tuple(outs), dur(), i, random=is_random,
                            writes=writes))
        fwd_io.append((tuple(ins), tuple(outs)))
        produced.extend(outs)
        prev = outs[0]
    sizes["loss"] = rng.randint(1, 8)
    specs.append(OpSpec("loss", Phase.LOSS, (prev,), ("loss",), dur()))
    grad = "loss"
    for i in reversed(range(n)):
        ins, outs = fwd_io[i]
        candidates = [t for t in dict.fromkeys(ins + outs) if t not in overwritten]
        picked = [t for t in candidates if rng.random() < 0.6] or ([rng.choice(candidates)] if candidates else [])
        out = f"g{i}"
        sizes[out] = size()
        specs.append(bwd(f"b{i}", (grad, *[t for t in picked if t != grad]), (out,), dur(), layer=i))
        grad = out
    specs.append(bwd("b_embed", (grad,), (), dur()))
    holds: dict[str, str] = {}
    if held:
        for i, spec in enumerate(specs):
            if spec.phase == Phase.FORWARD:
                for t in spec.outputs:
                    if rng.random() < 0.3:
                        holds[t] = specs[rng.randint(i, len(specs) - 1)].name
    return make_graph(specs, sizes, name=f"random{n}", bases=bases, held_until=holds)


def aliasing_graph() -> Graph:
    """A hand-made attention-like step with what traced programs have: q/k/v views of one qkv storage,
    a random dropout op (output + mask), and an in-place ReLU whose result aliases its input.

    Sizes (bytes): x 100, qkv 300 (q, k, v: views of 100 each), s 50, drop 50 + mask 25, ctx 100
    (relu_ writes it in place: `act` aliases it), loss 1, gradients 10.
    """
    specs = [
        fwd("embed", (), ("x",), 1.0),
        fwd("qkv", ("x",), ("qkv",), 1.0),
        fwd("split", ("qkv",), ("q", "k", "v"), 1.0),
        fwd("scores", ("q", "k"), ("s",), 1.0),
        OpSpec("drop", Phase.FORWARD, ("s",), ("sd", "mask"), 1.0, random=True),
        fwd("pv", ("sd", "v"), ("ctx",), 1.0),
        OpSpec("relu_", Phase.FORWARD, ("ctx",), ("act",), 1.0, writes=("ctx",)),
        OpSpec("loss", Phase.LOSS, ("act",), ("loss",), 1.0),
        bwd("relu_bwd", ("loss", "act"), ("g_ctx",), 1.0),
        bwd("pv_bwd", ("g_ctx", "sd", "v"), ("g_sd",), 1.0),
        bwd("drop_bwd", ("g_sd", "mask"), ("g_s",), 1.0),
        bwd("scores_bwd", ("g_s", "q", "k"), ("g_qkv",), 1.0),
        bwd("qkv_bwd", ("g_qkv", "x"), (), 1.0),
    ]
    sizes = {"x": 100, "qkv": 300, "q": 100, "k": 100, "v": 100, "s": 50, "sd": 50, "mask": 25, "ctx": 100,
             "act": 100, "loss": 1, "g_ctx": 10, "g_sd": 10, "g_s": 10, "g_qkv": 10}
    bases = {"q": "qkv", "k": "qkv", "v": "qkv", "act": "ctx"}
    return make_graph(specs, sizes, name="aliasing", bases=bases)


def schedule_from_decisions(
    graph: Graph,
    decisions: Mapping[str, Decision],
    rng: random.Random | None = None,
    planner: str = "test",
) -> Plan:
    """A valid explicit schedule for `decisions` (the simulator's tests need one without a planner).

    Recompute: one recompute step of the producer, right before the first backward reader (outputs
    sharing producer and reader share the step). Swap: offload issued right after the producing step
    and prefetch right before the first backward-side reader; with `rng`, both at random valid
    positions instead. Transfer lists are sorted by issue step.
    """
    by_reader: dict[str, dict[str, list[str]]] = {}
    for t in graph.saved_tensors:
        if decisions[t.name] != Decision.RECOMPUTE:
            continue
        first = min(
            (c for c in t.consumers if graph.op_by_name[c].phase not in FORWARD_PHASES), key=graph.op_index.__getitem__
        )
        by_reader.setdefault(first, {}).setdefault(t.producer, []).append(t.name)
    steps: list[ComputeStep] = []
    for op in graph.ops:
        for producer, outs in by_reader.get(op.name, {}).items():
            steps.append(ComputeStep(producer, StepKind.RECOMPUTE, tuple(outs)))
        steps.append(ComputeStep(op.name, StepKind.RUN, op.outputs))

    reads: dict[str, list[tuple[int, bool]]] = {}
    run_index: dict[str, int] = {}
    for j, st in enumerate(steps):
        op = graph.op_by_name[st.op]
        if st.kind == StepKind.RUN:
            run_index[op.name] = j
        forward_run = st.kind == StepKind.RUN and op.phase in FORWARD_PHASES
        for t in op.inputs:
            reads.setdefault(t, []).append((j, forward_run))
    offloads: list[tuple[int, int, str]] = []
    prefetches: list[tuple[int, int, str]] = []
    for order, t in enumerate(graph.saved_tensors):
        if decisions[t.name] != Decision.SWAP:
            continue
        prod = run_index[t.producer]
        last_fwd = max([j for j, f in reads[t.name] if f], default=prod)
        first_bwd = min(j for j, f in reads[t.name] if not f and j > last_fwd)
        if rng is None:
            off, pre = prod, first_bwd - 1
        else:
            pre = rng.randint(last_fwd, first_bwd - 1)
            off = rng.randint(prod, pre)
        offloads.append((off, order, t.name))
        prefetches.append((pre, order, t.name))
    return Plan(
        planner=planner,
        budget_bytes=None,
        decisions=dict(decisions),
        steps=tuple(steps),
        offloads=tuple(Transfer(t, Direction.D2H, i) for i, _, t in sorted(offloads)),
        prefetches=tuple(Transfer(t, Direction.H2D, i) for i, _, t in sorted(prefetches)),
    )


def random_decisions(graph: Graph, rng: random.Random) -> dict[str, Decision]:
    """Keep, swap or recompute for each saved tensor. Only forward-produced tensors can be recomputed,
    and not those whose producer reads a tensor some op overwrites in place (the recompute would read
    the overwritten version)."""
    out = {}
    written = {w for op in graph.ops for w in op.writes}
    for t in graph.saved_tensors:
        choices = [Decision.KEEP, Decision.SWAP]
        producer = graph.op_by_name[t.producer]
        if producer.phase in FORWARD_PHASES and not written.intersection(producer.inputs):
            choices.append(Decision.RECOMPUTE)
        out[t.name] = rng.choice(choices)
    return out


def random_valid_plan(graph: Graph, rng: random.Random) -> Plan:
    return schedule_from_decisions(graph, random_decisions(graph, rng), rng=rng)
