"""One pipeline stage's graph: the op graph of one micro-batch's step on stage i of parallel.pp.

Stage i of p holds layers [i L/p, (i + 1) L/p) of the model's L (Megatron-LM's even split; pp must
divide the layers, `ParallelConfig.check_model`); the first stage also holds the embedding, the last
the final norm, LM head and loss. Under the interleaved schedule the stage index is a model chunk's
(virtual stage) of the n = pp x virtual_stages: chunk s holds layers [s L/n, (s + 1) L/n) and runs on
device s mod pp (Megatron-LM's virtual pipeline split); the first chunk holds the embedding, the last
the head. The graph is one rank's under the rest of the layout (tp, sp, cp
as `build_graph`), numbered with the stage's own layers 0 .. L/p - 1 so the layer-based planners see
a stack of L/p layers.

A stage that is not the first starts with `p2p.recv` (no inputs, writes the activation received from
stage i - 1: the buffer the stage allocates for it); its backward `p2p.recv.bwd` reads the gradient
of that activation, the one the stage sends back. A stage that is not the last ends its forward with
`p2p.send` (reads the stage output); its backward `p2p.send.bwd` writes the output's gradient, the
one received from stage i + 1. The four boundary ops take no time here: the transfers are the
pipeline's sends (`slackswap.simulate.pipeline`), on the link between the stages, not on the stage's
compute stream. GPT-2 and BERT tie the LM head to the token embedding; the last stage keeps its own
copy of the word embeddings (Megatron-LM does, and all-reduces its gradient with the first stage's),
so its parameter count includes it.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from slackswap.errors import ConfigError
from slackswap.graph import NO_LAYER, Graph, OpClass
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ModelConfig
from slackswap.parallel import ParallelConfig
from slackswap.profile.builder import GraphBuilder, add_optimizer_steps
from slackswap.profile.collectives import to_json
from slackswap.profile.layers import FamilyBuilder

#: The ops at a stage's boundaries, timed 0 (the pipeline times the sends).
BOUNDARY_OPS: frozenset[str] = frozenset({"p2p.recv", "p2p.recv.bwd", "p2p.send", "p2p.send.bwd"})


def stage_layers(model: ModelConfig, parallel: ParallelConfig, stage: int) -> range:
    """The model's layers stage (chunk) `stage` holds (global indices)."""
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < parallel.chunks:
        raise ConfigError("stage", stage, f"must be an integer in [0, {parallel.chunks}) "
                                          f"(parallel.pp x parallel.virtual_stages)")
    per = model.num_layers // parallel.chunks
    return range(stage * per, (stage + 1) * per)


def _emit_stage(model: ModelConfig, gb: GraphBuilder, parallel: ParallelConfig, stage: int,
                fp8_linear_inputs: bool) -> FamilyBuilder:
    """Emit stage `stage`'s forward (boundary ops included) into `gb`."""
    parallel.check_model(model)
    fb = FamilyBuilder(model, gb, parallel, fp8_linear_inputs)
    layer_fn = {"bert": fb.bert_layer, "gpt2": fb.gpt2_layer, "llama": fb.llama_layer}[model.family]
    first, last = stage == 0, stage == parallel.chunks - 1
    fb.first_layer_index = stage_layers(model, parallel, stage).start
    if first:
        x = fb.embedding()
    else:
        x = gb.tensor("p2p.recv.out", fb.shape.rep(model.hidden_size), "p2p_recv")
        gb.forward("p2p.recv", OpClass.ELEMENTWISE, NO_LAYER, (), (x,), role="p2p_recv")
    for local in range(len(stage_layers(model, parallel, stage))):
        x = layer_fn(local, x)
    if last:
        if not first and model.family in ("bert", "gpt2"):
            fb._count(NO_LAYER, fb.shape.vocab_shard * model.hidden_size)  # the last stage's embedding copy
        fb.head_and_loss(x)
    else:
        gb.forward("p2p.send", OpClass.ELEMENTWISE, NO_LAYER, (x,), (), role="p2p_send")
    return fb


def stage_parameter_counts(model: ModelConfig, parallel: ParallelConfig, stage: int) -> tuple[int, int]:
    """(parameters, largest parameter group) of one rank of stage `stage`, counted as its graph is built."""
    groups = stage_group_parameters(model, parallel, stage)
    return sum(groups.values()), max(groups.values())


def stage_group_parameters(model: ModelConfig, parallel: ParallelConfig, stage: int) -> dict[int, int]:
    """Parameters of each parameter group of one rank of stage `stage`: its layers (local indices, global
    `stage_layers(...)[i]`) and `NO_LAYER` (embedding, final norm, head). The groups are ZeRO-3's gather
    units; under expert parallelism a layer's count holds this rank's experts, which the advise search
    splits off (its experts form their own unit over the expert data-parallel group)."""
    gb = GraphBuilder(None, model.dtype)
    return dict(_emit_stage(model, gb, parallel, stage, False).layer_params)


def build_stage_graph(model: ModelConfig, hardware: Hardware, training: TrainingConfig,
                      parallel: ParallelConfig, stage: int) -> Graph:
    """The op graph of one micro-batch's training step on pipeline stage `stage` (one rank of it)."""
    from slackswap.profile import state_bytes_per_param

    hardware.peak_for(model.dtype)
    training.check_model_dtype(model.dtype)
    gb = GraphBuilder(hardware, model.dtype, model.attention_kernel)
    fb = _emit_stage(model, gb, parallel, stage, training.fp8_linear_inputs)
    gb.backward()
    if model.include_optimizer:
        add_optimizer_steps(gb, fb.layer_params, training, model.dtype)
    w, g, state = state_bytes_per_param(model.dtype)
    graph = gb.finish(
        f"{model.name}@{hardware.name}/stage{stage}of{parallel.chunks}",
        len(stage_layers(model, parallel, stage)),
        weight_bytes=w * fb.params,
        weight_grad_bytes=g * fb.params,
        optimizer_state_bytes=state * fb.params,
        meta={
            "model": asdict(model),
            "hardware": hardware.name,
            "num_params": fb.params,
            "max_unit_params": max(fb.layer_params.values()),
            "parallel": {"layout": parallel.as_dict(), "collectives": to_json(fb.collectives)},
            "pipeline_stage": {"stage": stage, "stages": parallel.chunks, "device": stage % parallel.pp,
                               "layers": [stage_layers(model, parallel, stage)[0],
                                          stage_layers(model, parallel, stage)[-1] + 1]},
        },
    )
    ops = tuple(replace(op, duration_s=0.0) if op.name in BOUNDARY_OPS else op for op in graph.ops)
    return replace(graph, ops=ops)


def boundary_bytes(graph: Graph) -> int:
    """Bytes stage `graph` sends forward per micro-batch (its output activation; 0 for the last stage)."""
    send = graph.op_by_name.get("p2p.send")
    return sum(graph.tensors[t].size_bytes for t in send.inputs) if send is not None else 0


def expert_shards(parallel: ParallelConfig, zero_stage: int, zero_shards: int) -> int:
    """GPUs one routed expert's ZeRO state is sharded over: of the `zero_shards` ranks the dense state is
    sharded over (at most the dp x cp ranks that hold the same dense parameters, `ParallelConfig.dp_cp`;
    the ep group is carved out of them), the ranks that hold the same experts, zero_shards / ep
    (Megatron-Core's expert data-parallel group dp x cp / ep, torchtitan's efsdp = dp_shard x cp / ep),
    at least 1. Stage 0 shards nothing."""
    return max(1, zero_shards // parallel.ep) if zero_stage else 1


def routed_expert_params(model: ModelConfig, ep: int) -> int:
    """Parameters of one MoE layer's routed experts on one of `ep` ranks: its E / ep experts' gate, up and
    down weights, 3 h f_e each (`slackswap.profile.moe`; shared experts and the router are dense)."""
    return model.moe.num_experts // ep * 3 * model.hidden_size * model.moe.expert_ffn_hidden_size


def chunk_units(model: ModelConfig, parallel: ParallelConfig, chunk: int) -> tuple[int, int, int]:
    """(largest dense parameter group, largest routed-expert group, routed-expert parameters) of one rank
    of chunk `chunk`: ZeRO-3's gather units once the experts are split off. A layer's group less its
    routed experts is dense, the embedding / head group is dense, one MoE layer's experts are their own
    unit (torchtitan wraps `moe.experts` in its own `fully_shard` over the expert mesh)."""
    each = 0 if model.moe is None else routed_expert_params(model, parallel.ep)
    first = stage_layers(model, parallel, chunk).start
    dense_unit = expert_unit = experts = 0
    for group, n in stage_group_parameters(model, parallel, chunk).items():
        e = each if group != NO_LAYER and model.moe is not None and model.moe.is_moe_layer(first + group) else 0
        dense_unit, expert_unit, experts = max(dense_unit, n - e), max(expert_unit, e), experts + e
    return dense_unit, expert_unit, experts


def device_static_memory(model: ModelConfig, parallel: ParallelConfig, training: TrainingConfig, device: int):
    """Static memory of one rank of pipeline device `device` (its chunks' parameters) under `training`.

    On an MoE model under ep > 1 the routed experts' state is sharded over `expert_shards` GPUs, the dense
    parameters' over `training.zero_shards`, term by term summed; ZeRO-3 gathers two units of each
    (`chunk_units`), the rule of the advise layout search (docs/advise.md, "Layouts"). Otherwise every
    parameter under `training`, as before experts were split."""
    from slackswap.memory.static import static_memory

    chunks = range(device, parallel.chunks, parallel.pp)
    groups = [stage_group_parameters(model, parallel, c) for c in chunks]
    total = sum(sum(g.values()) for g in groups)
    if model.moe is None or parallel.ep == 1:
        return static_memory(total, max(max(g.values()) for g in groups), training, model.dtype)
    units = [chunk_units(model, parallel, c) for c in chunks]
    experts = sum(u[2] for u in units)
    if not experts:
        return static_memory(total, max(max(g.values()) for g in groups), training, model.dtype)
    shards = expert_shards(parallel, training.zero_stage, training.zero_shards)
    dense = static_memory(total - experts, max(u[0] for u in units), training, model.dtype)
    expert = static_memory(experts, max(u[1] for u in units), replace(training, zero_shards=shards), model.dtype)
    return replace(dense, num_params=total, **{k: v + expert.terms()[k] for k, v in dense.terms().items()})
