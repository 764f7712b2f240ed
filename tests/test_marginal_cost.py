"""`order_by_marginal_cost` does not re-walk chains after a pick (the lengthening is all covered ops);
it must give the order of the definition, which re-walks every affected candidate's chain with
`regen_chain` after each pick."""

from __future__ import annotations

import heapq
import random

import pytest

from slackswap.planners.support.analysis import analyse, regen_chain
from slackswap.planners.support.greedy import order_by_marginal_cost, recompute_candidates
from slackswap.testing import bwd, fwd, make_graph, random_graph, toy_hardware


def order_by_walking_chains(graph, analysis, candidates):
    """The definition: after each pick, every candidate whose chain touches a newly covered op or a
    consumer of the picked tensor is re-chained from scratch and re-priced."""
    dur = {op.name: op.duration_s for op in graph.ops}
    missing, covered = set(), set()
    chain = {t: analysis.tensors[t].regen_ops for t in candidates}
    users = {}
    for t, ops in chain.items():
        for o in ops:
            users.setdefault(o, set()).add(t)
    version = dict.fromkeys(candidates, 0)
    rank = {t: i for i, t in enumerate(candidates)}

    def key(t):
        return sum(dur[o] for o in chain[t] if o not in covered) / max(analysis.tensors[t].size_bytes, 1)

    heap = [(key(t), rank[t], 0, t) for t in candidates]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, v, t = heapq.heappop(heap)
        if v != version[t] or t in missing:
            continue
        order.append(t)
        missing.add(t)
        new_ops = [o for o in chain[t] if o not in covered]
        covered.update(new_ops)
        touched = set(new_ops) | set(graph.tensors[t].consumers)
        for z in set().union(*(users.get(o, ()) for o in touched)) - missing:
            chain[z] = regen_chain(graph, z, missing)
            for o in chain[z]:
                users.setdefault(o, set()).add(z)
            version[z] += 1
            heapq.heappush(heap, (key(z), rank[z], version[z], z))
    return order


@pytest.mark.parametrize("seed", range(12))
def test_incremental_chains_give_the_order_of_the_definition(seed):
    rng = random.Random(seed)
    graph = random_graph(rng, max_layers=6)
    analysis = analyse(graph, toy_hardware(100.0, 100.0, 0.0, 1, 1))
    taken = {t for t in analysis.tensors if rng.random() < 0.3}
    candidates = recompute_candidates(graph, analysis, taken)
    assert order_by_marginal_cost(graph, analysis, candidates) == order_by_walking_chains(graph, analysis, candidates)


def chained_layers_graph(rng: random.Random, layers: int = 4, ops_per_layer: int = 6):
    """Layers of a few forward ops in a chain, where backward reads a random subset of the chain's
    tensors: the others are unsaved, so a recompute chain runs back through them (as the residual
    stream does in traced graphs) and picking one tensor lengthens the chains of later ones."""
    specs, sizes, saved_by_layer = [fwd("embed", (), ("x",), 1.0)], {"x": 10}, []
    prev = "x"
    for layer in range(layers):
        chain = []
        for k in range(ops_per_layer):
            out = f"t{layer}_{k}"
            sizes[out] = rng.randint(1, 100)
            specs.append(fwd(f"f{layer}_{k}", (prev,), (out,), rng.choice([0.5, 1.0, 2.0]), layer=layer))
            chain.append(out)
            prev = out
        saved_by_layer.append([t for t in chain if rng.random() < 0.5] or [chain[0]])
    sizes["loss"] = 1
    specs.append(fwd("loss", (prev,), ("loss",), 1.0, layer=layers))
    grad = "loss"
    for layer in reversed(range(layers)):
        out = f"g{layer}"
        sizes[out] = 10
        specs.append(bwd(f"b{layer}", (grad, *saved_by_layer[layer]), (out,), 1.0, layer=layer))
        grad = out
    return make_graph(specs, sizes, name="chained")


@pytest.mark.parametrize("seed", range(12))
def test_incremental_chains_on_chains_through_unsaved_tensors(seed):
    rng = random.Random(seed)
    graph = chained_layers_graph(rng)
    analysis = analyse(graph, toy_hardware(100.0, 100.0, 0.0, 1, 1))
    candidates = recompute_candidates(graph, analysis, set())
    assert len(candidates) > 2
    assert order_by_marginal_cost(graph, analysis, candidates) == order_by_walking_chains(graph, analysis, candidates)


def group_order_by_walking_chains(graph, analysis, candidates):
    """The definition of slackswap's group ranking: after each pick, every group whose chains touch a
    newly covered op or read a picked tensor is re-chained from scratch and re-priced."""
    dur = {op.name: op.duration_s for op in graph.ops}
    rank = {t: i for i, t in enumerate(candidates)}
    members = {}
    for t in candidates:
        members.setdefault(graph.tensors[t].producer, []).append(t)
    missing, covered = set(), set()
    chain = {t: analysis.tensors[t].regen_ops for t in candidates}
    users = {}

    def index(group):
        for t in members[group]:
            for o in chain[t]:
                users.setdefault(o, set()).add(group)

    for group in members:
        index(group)

    def key(group):
        ops = {o for t in members[group] for o in chain[t]} - covered
        return sum(dur[o] for o in ops) / sum(max(analysis.tensors[t].size_bytes, 1) for t in members[group])

    version = dict.fromkeys(members, 0)
    heap = [(key(g), min(rank[t] for t in ts), 0, g) for g, ts in members.items()]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, v, group = heapq.heappop(heap)
        if v != version[group] or not members[group]:
            continue
        picked = members[group]
        members[group] = []
        order.extend(picked)
        missing.update(picked)
        new_ops = {o for t in picked for o in chain[t]} - covered
        covered.update(new_ops)
        touched = set(new_ops) | {c for t in picked for c in graph.tensors[t].consumers}
        for g in set().union(*(users.get(o, ()) for o in touched)) - {group}:
            if not members[g]:
                continue
            for t in members[g]:
                chain[t] = regen_chain(graph, t, missing)
            index(g)
            version[g] += 1
            heapq.heappush(heap, (key(g), min(rank[t] for t in members[g]), version[g], g))
    return order


@pytest.mark.parametrize("seed", range(12))
def test_group_ranking_gives_the_order_of_the_definition(seed):
    from slackswap.planners.strategies.slackswap import order_by_group_marginal_cost

    rng = random.Random(seed)
    graph = chained_layers_graph(rng) if seed % 2 else random_graph(rng, max_layers=6)
    analysis = analyse(graph, toy_hardware(100.0, 100.0, 0.0, 1, 1))
    candidates = recompute_candidates(graph, analysis, set())
    assert order_by_group_marginal_cost(graph, analysis, candidates) == group_order_by_walking_chains(
        graph, analysis, candidates
    )
