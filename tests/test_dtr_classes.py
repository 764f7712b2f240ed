"""DTR's h_DTR^eq (`dtr._EvictedClasses`, `dtr._dtr_evictions`) against hand-worked figures and a scan.

The replay files candidates by key and keeps class costs as running sums in a union-find; the scan
below keeps every class as an explicit set of member ops, sums a tensor's cost from those sets at
every choice and looks at every candidate. The two must make the same evictions in the same order,
rematerialise as often and get stuck at the same op, whatever `hub_adjacent` (which only decides how
the replay files tensors next to large classes)."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from slackswap.graph import FORWARD_PHASES
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.planners.strategies import dtr
from slackswap.profile import build_graph
from slackswap.schedule import estimate_plan, keep_all_plan
from slackswap.testing import random_graph, toy_hardware
from tests.extras import require_torch_extra

CONF = Path(__file__).resolve().parents[1] / "conf"
A100 = Hardware.from_dict(yaml.safe_load((CONF / "hardware" / "a100_80gb_pcie4.yaml").read_text()))


def _classes(hub_adjacent: int = 10**9) -> dtr._EvictedClasses:
    # ops a - b - c - d in a row (each shares a tensor with the next), costs 1, 2, 4, 8 ps;
    # tensor td (made by d) has upstream ops d and c, tensor tb (made by b) has b and a.
    return dtr._EvictedClasses(
        {"a": 1, "b": 2, "c": 4, "d": 8},
        {"a": ("b",), "b": ("a", "c"), "c": ("b", "d"), "d": ("c",)},
        {"a": ("tb",), "b": ("tb",), "c": ("td",), "d": ("td",)},
        hub_adjacent,
    )


def _cost(classes: dtr._EvictedClasses, tensor: str, producer: str, upstream: tuple[str, ...]) -> int:
    fixed, _, hubs = classes.key(tensor, producer, upstream, 1)
    return fixed + sum(classes.cost_ps[root] for root in hubs)


def test_classes_sum_their_members_and_are_not_split_by_a_rematerialisation():
    classes = _classes()
    assert _cost(classes, "td", "d", ("c", "d")) == 8  # nothing evicted: d's own cost
    classes.output_off("a")
    classes.output_off("c")
    assert _cost(classes, "td", "d", ("c", "d")) == 8 + 4  # c's class {c}; a's class is not next to td
    assert classes.changed == {"tb", "td"}
    classes.output_off("b")  # joins a's and c's classes into {a, b, c}
    assert classes.find(classes.node_of["a"]) == classes.find(classes.node_of["c"])
    assert _cost(classes, "td", "d", ("c", "d")) == 8 + 1 + 2 + 4
    assert _cost(classes, "tb", "b", ("a", "b")) == 7  # b is in the class already: no own cost
    classes.output_on("b")  # b leaves; a and c stay in one class, which loses b's cost
    assert "b" not in classes.node_of
    assert classes.find(classes.node_of["a"]) == classes.find(classes.node_of["c"])
    assert _cost(classes, "td", "d", ("c", "d")) == 8 + 1 + 4
    assert _cost(classes, "tb", "b", ("a", "b")) == 2 + 5
    classes.output_off("d")
    classes.output_off("d")  # a second output of d: d is paid once, and stays until both are back
    classes.output_on("d")
    assert _cost(classes, "td", "d", ("c", "d")) == 1 + 4 + 8


def test_a_hub_is_filed_by_root_and_priced_when_asked():
    classes = _classes(hub_adjacent=0)
    classes.output_off("c")
    fixed, size, hubs = classes.key("td", "d", ("c", "d"), 3)
    assert (fixed, size, hubs) == (8, 3, (classes.find(classes.node_of["c"]),))
    classes.changed.clear()
    classes.output_off("d")  # the hub's cost changes; nothing next to it needs refiling for that
    assert classes.changed == {"td"}  # only because d itself is now in the class
    assert classes.key("td", "d", ("c", "d"), 3)[0] == 0
    assert classes.cost_ps[classes.find(classes.node_of["d"])] == 12


def _replay_by_scanning(graph, hardware, budget_bytes) -> tuple[list[str], int]:
    """h_DTR^eq by its definition: explicit classes (relabelled on merge), every cost summed from them,
    every candidate looked at."""
    timeline = estimate_plan(graph, keep_all_plan(graph), hardware)
    tensors = graph.tensors
    forward_ops = {op.name for op in graph.ops if op.phase in FORWARD_PHASES}
    forward_tensors = {t for op in graph.ops if op.name in forward_ops for t in op.outputs}
    evictable = {t.name for t in graph.saved_tensors if t.producer in forward_ops and t.size_bytes > 0}
    op_cost = {op.name: round(op.duration_s * 10**12) for op in graph.ops}
    off_outputs: Counter[str] = Counter()
    class_of: dict[str, int] = {}
    class_ids = itertools.count()

    def near(op):
        o = graph.op_by_name[op]
        ops = {tensors[t].producer for t in o.inputs} | {c for t in o.outputs for c in tensors[t].consumers}
        return (ops & forward_ops) - {op}

    def output_off(op):
        off_outputs[op] += 1
        if off_outputs[op] == 1:
            new = class_of[op] = next(class_ids)
            merged = {class_of[q] for q in near(op) if q in class_of}
            for member, cid in list(class_of.items()):
                if cid in merged:
                    class_of[member] = new

    def output_on(op):
        off_outputs[op] -= 1
        if off_outputs[op] == 0:
            del class_of[op]

    def cost(t):
        producer = tensors[t].producer
        upstream = {producer} | {tensors[i].producer for i in graph.op_by_name[producer].inputs}
        classes = {class_of[q] for q in upstream if q in class_of}
        own = 0 if producer in class_of else op_cost[producer]
        return own + sum(op_cost[m] for m, cid in class_of.items() if cid in classes)

    size = {name: t.size_bytes for name, t in tensors.items()}
    readers_left = {name: len(t.consumers) for name, t in tensors.items()}
    forward_readers_left = {name: sum(c in forward_ops for c in t.consumers) for name, t in tensors.items()}
    resident, evicted, victims, last_access = set(), set(), [], {}
    in_use = remats = 0
    for i, op in enumerate(graph.ops):
        now = timeline.step_start_s[i]
        pinned = set(op.inputs) | set(op.outputs)
        for t in op.inputs:
            if t in evicted:
                evicted.discard(t)
                resident.add(t)
                in_use += size[t]
                remats += 1
                output_on(tensors[t].producer)
        for t in op.outputs:
            resident.add(t)
            in_use += size[t]
            last_access[t] = now
            if t in forward_tensors and not tensors[t].saved:
                output_off(op.name)
        while in_use > budget_bytes:
            candidates = [t for t in resident if t in evictable and t not in pinned
                          and forward_readers_left[t] == 0 and readers_left[t] > 0]
            if not candidates:
                raise dtr.DtrCannotFit(op.name, in_use)
            victim = min(candidates, key=lambda t: (
                cost(t) / (size[t] * max(now - last_access[t], dtr._MIN_STALENESS_S)), t))
            resident.discard(victim)
            evicted.add(victim)
            victims.append(victim)
            in_use -= size[victim]
            output_off(tensors[victim].producer)
        end = timeline.step_end_s[i]
        for t in op.inputs:
            last_access[t] = end
            readers_left[t] -= 1
            forward_readers_left[t] -= op.name in forward_ops
        for t in pinned:
            if readers_left[t] == 0 and t in resident:
                resident.discard(t)
                in_use -= size[t]
                if t in forward_tensors and tensors[t].saved:
                    output_off(tensors[t].producer)
            if readers_left[t] == 0:
                evicted.discard(t)
    return victims, remats


def _outcome(replay, graph, hw, budget, **options):
    try:
        return replay(graph, hw, budget, **options)
    except dtr.DtrCannotFit as exc:
        return ("cannot fit", exc.op, exc.in_use_bytes)


def _compare(graphs, fractions, hub_choices) -> int:
    """Replay and scan at each budget; the number of replays that evicted something."""
    evicting = 0
    for n, (graph, hw) in enumerate(graphs):
        peak = estimate_plan(graph, keep_all_plan(graph), hw).peak_bytes
        for fraction in fractions:
            budget = int(fraction * peak)
            scanned = _outcome(_replay_by_scanning, graph, hw, budget)
            for hub in hub_choices[n % len(hub_choices)]:
                assert _outcome(dtr._dtr_evictions, graph, hw, budget, hub_adjacent=hub) == scanned, (n, fraction, hub)
            evicting += scanned[0] != "cannot fit" and len(scanned[0]) > 0
    return evicting


def test_replay_evicts_as_the_scan_does_on_random_graphs_and_presets():
    graphs = []
    for seed in range(200):
        rng = random.Random(seed)
        graphs.append((random_graph(rng, max_layers=10, real_program=seed % 2 == 1),
                       toy_hardware(rng.choice([20.0, 200.0]), rng.choice([20.0, 200.0]))))
    for model in ("tiny", "bert_large", "gpt2_xl", "llama2_70b"):
        data = yaml.safe_load((CONF / "model" / f"{model}.yaml").read_text())
        graphs.append((build_graph(ModelConfig.from_dict({**data, "num_layers": 3}), A100), A100))
    hub_choices = [(0, dtr.HUB_ADJACENT), (2, 10**9), (dtr.HUB_ADJACENT,)]
    assert _compare(graphs, (0.1, 0.3, 0.5, 0.7, 0.9), hub_choices) >= 200


@pytest.mark.slow
def test_replay_evicts_as_the_scan_does_on_traced_graphs():
    require_torch_extra("torch")
    from slackswap.profile.torch import build_torch_graph
    from slackswap.profile.torch.spec import TorchSpec

    tiny = ModelConfig.from_dict(yaml.safe_load((CONF / "model" / "tiny.yaml").read_text()))
    llama = ModelConfig(name="small_llama", family="llama", num_layers=4, hidden_size=64, num_heads=4,
                        num_kv_heads=2, ffn_hidden_size=128, seq_len=16, micro_batch_size=2, vocab_size=96,
                        dropout=False)
    graphs = [(build_torch_graph(replace(tiny, num_layers=3), TorchSpec("tiny_gpt"), A100), A100),
              (build_torch_graph(llama, TorchSpec("hf_llama", attention="sdpa"), A100), A100)]
    assert _compare(graphs, (0.2, 0.4, 0.6, 0.8), [(0, 3, dtr.HUB_ADJACENT)]) >= 6


def test_filing_keys_do_not_grow_with_depth(monkeypatch):
    """What makes the replay linear: an eviction looks at one candidate per filing key, and deeper
    models repeat the same keys (the hub classes' costs are read, not filed)."""
    seen: list[int] = []
    least = dtr._Candidates.least

    def counting(self, now, pinned):
        seen.append(len(self._groups))
        return least(self, now, pinned)

    monkeypatch.setattr(dtr._Candidates, "least", counting)
    data = yaml.safe_load((CONF / "model" / "llama2_70b.yaml").read_text())
    most = {}
    for layers in (8, 32):
        graph = build_graph(ModelConfig.from_dict({**data, "num_layers": layers}), A100)
        seen.clear()
        dtr._dtr_evictions(graph, A100, int(0.5 * estimate_plan(graph, keep_all_plan(graph), A100).peak_bytes))
        most[layers] = max(seen)
    assert len(seen) > 4 * 8 and most[32] <= most[8] + 2
