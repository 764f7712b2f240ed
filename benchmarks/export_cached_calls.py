"""What a call the selective-checkpoint cache serves costs in an eager export's replay, against what the
CPU prediction charges for it.

`python benchmarks/export_cached_calls.py` (CPU, one intra-op thread). In a SAC layer's replay an op the
policy saved is served from the cache: no kernel, but the layer's Python forward runs again in full, so
the module code and the host path leading to that call run again too. The prediction
(`slackswap.experiment.measured_executor.predict_export`) charges such a call the SAC modes' cost per
call (`slackswap.runtime.export.dispatch_cost`, measured on fixed MLP blocks at the model's shape with every
call recomputed) and nothing else; the executed recomputes and the views are charged their op times on top. This checks,
on the real layers of the measured-profile benchmark's models, whether anything is left:

1. the model's op-time table (process CPU clock) and the torch_sac plan made for the export, as
   `benchmarks/measured_profile.py` makes them; the first SAC layer's replay ops by kind
   (`slackswap.experiment.measured_executor.sac_replay_ops`);
2. that layer's forward, with gradients on as in a recompute, run under the export's replay mode
   (`_ReplayMode`) with the plan's cache (each cached call served a recorded output, every other call
   recomputed), thread CPU time stamped around each call in the mode: a cached call costs the time
   from the end of the mode's previous call to the start of its own (the module code and the C++ path
   leading to it, the stamps included) plus its time inside the mode. Their sum over the layer's
   cached calls, median of the repeats, against the cached calls times the per-call cost charged
   (measured in the same run): what a cached call costs that the prediction does not charge
   (negative: charged more than it costs);
3. a check through the whole replay, unstamped, alternating: the replay with the plan's cache against
   the same replay with every call recomputed. Both make the same calls through the same mode, so the
   difference is what the cache saves, which the prediction puts at the cached ops' op times (their
   calls are charged alike in both). It carries the op-time table's own noise (a few hundred us a layer
   between runs at load 2), so it is a check of sign and size, not the figure.

Results: benchmarks/results/export_cached_calls.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples" / "byo_model")]

from benchmarks.common import conf, machine, save_result  # noqa: E402

MODELS = ("hf_gpt2_2l", "tiny_torch", "small_bert", "small_llama")


def _layer_inputs(w, layer):
    """The layer's arguments from one forward of the model, detached (floats requiring gradients, as a
    checkpoint's recompute gets them)."""
    import torch
    from torch.utils._pytree import tree_map

    got = {}
    hook = layer.register_forward_pre_hook(lambda _m, a, k: got.setdefault("x", (a, k)), with_kwargs=True)
    try:
        w.model(w.batch)
    finally:
        hook.remove()

    def fresh(x):
        return x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x

    return tree_map(fresh, got["x"][0]), tree_map(fresh, got["x"][1])


def measure_model(name, model, spec, hardware, repeats: int, per_call_s: float) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    from slackswap.experiment.export_plan import plan_for_export
    from slackswap.experiment.measured_executor import sac_replay_ops
    from slackswap.planners.registry import get_planner
    from slackswap.profile.measured import retime
    from slackswap.runtime import capture_graph
    from slackswap.runtime.export.install import layer_paths
    from slackswap.runtime.export.modes import RECOMPUTE, SAVE, _Entry, _ReplayMode
    from slackswap.runtime.export.policy import _IGNORED
    from slackswap.runtime.op_times import measure_op_times
    from slackswap.runtime.training_workload import build_training_workload

    w = build_training_workload(model, spec, "cpu", 0)
    graph = capture_graph(w.model, (w.batch,), w.loss_fn, hardware, name)
    timed, _ = retime(graph, measure_op_times(graph, w.model, (w.batch,), w.loss_fn, 2, 5, "process"))
    options = dict(conf("planner", "torch_sac").get("options") or {})
    plan = plan_for_export(get_planner("torch_sac", **options), timed, w.model, hardware, None)
    replay_ops = sac_replay_ops(timed, plan, w.model)
    if not replay_ops:
        return {"model": name, "skipped": "no layer under the SAC policy"}
    region = min(replay_ops)
    kinds = [kind for _, kind, calls in replay_ops[region] for _ in range(calls)]
    layer = w.model.get_submodule(layer_paths(w.model)[region])
    args, kwargs = _layer_inputs(w, layer)

    def detached(x):
        return x.detach() if isinstance(x, torch.Tensor) else x

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls, self.index = [], {}

        def __torch_dispatch__(self, func, types, a=(), k=None):
            out = func(*a, **(k or {}))
            if func not in _IGNORED:
                i = self.index.get(func, 0)
                self.index[func] = i + 1
                self.calls.append(((func, i), tree_map(detached, out)))
            return out

    record = Record()
    with record:
        layer(*args, **kwargs)
    if len(record.calls) < len(kinds):
        return {"model": name, "skipped": f"the layer made {len(record.calls)} calls, its replay {len(kinds)}"}
    kinds += ["executed"] * (len(record.calls) - len(kinds))  # after the replay's stop: alike in both

    class Stamped(_ReplayMode):
        def __init__(self, storage):
            super().__init__(storage, None)
            self.last, self.before, self.inside = None, [], []

        def __torch_dispatch__(self, func, types, a=(), k=None):
            t0 = time.thread_time_ns()
            out = super().__torch_dispatch__(func, types, a, k)
            if func not in _IGNORED:
                self.before.append(None if self.last is None else t0 - self.last)
                self.inside.append(time.thread_time_ns() - t0)
            self.last = time.thread_time_ns()
            return out

    def replay(cached: bool, mode=_ReplayMode) -> tuple[float, object]:
        storage = {key: _Entry(SAVE, tree_map(detached, out)) if cached and kind == "cached"
                   else _Entry(RECOMPUTE, None) for (key, out), kind in zip(record.calls, kinds, strict=True)}
        m = mode(storage) if mode is Stamped else mode(storage, None)
        c0 = time.thread_time_ns()
        with m:
            layer(*args, **kwargs)
        return (time.thread_time_ns() - c0) / 1e9, m

    with_cache, recomputed, stamps = [], [], []
    for i in range(5 + repeats):
        a, _ = replay(True)
        b, _ = replay(False)
        _, s = replay(True, Stamped)
        if i >= 5:
            with_cache.append(a)
            recomputed.append(b)
            stamps.append(s)
    ops = timed.op_by_name
    cached_calls = kinds.count("cached")
    cached_ops_s = sum(ops[op].duration_s for op, kind, _ in replay_ops[region] if kind == "cached")
    measured = statistics.median(with_cache) - statistics.median(recomputed)
    predicted = -cached_ops_s
    at = [j for j, kind in enumerate(kinds) if kind == "cached"]
    before = [statistics.median(s.before[j] for s in stamps) / 1e9 if stamps[0].before[j] is not None else 0.0
              for j in at]
    inside = [statistics.median(s.inside[j] for s in stamps) / 1e9 for j in at]
    return {"model": name, "layer": layer_paths(w.model)[region], "calls": len(kinds),
            "cached_calls": cached_calls, "executed_calls": kinds.count("executed"), "view_calls": kinds.count("views"),
            "cached_calls_cost_s": sum(before) + sum(inside),
            "cached_calls_charged_s": cached_calls * per_call_s,
            "unpriced_per_cached_call_s": (sum(before) + sum(inside)) / max(1, cached_calls) - per_call_s,
            "before_mode_median_s": statistics.median(before) if before else None,
            "inside_mode_median_s": statistics.median(inside) if inside else None,
            "replay_with_cache_s": statistics.median(with_cache), "replay_recomputed_s": statistics.median(recomputed),
            "cache_saves_s": -measured, "cached_ops_time_s": cached_ops_s,
            "check_unpriced_per_cached_call_s": (measured - predicted) / max(1, cached_calls),
            "repeats": repeats, "load": round(os.getloadavg()[0], 2)}


def run(repeats: int) -> dict:
    import torch

    from benchmarks.measured_cases import HARDWARE, cases
    from slackswap.experiment.measured_prediction import export_block_shape
    from slackswap.hardware import load_preset
    from slackswap.runtime.export.dispatch_cost import measure_dispatch_cost

    torch.set_num_threads(1)
    hardware = load_preset(HARDWARE)
    started = machine()
    rows = []
    for name, model, spec in cases():
        if name not in MODELS:
            continue
        # What a run charges every call of this model: the dispatch at its shape (docs/decisions/0026).
        width, tokens = export_block_shape(model)
        dispatch = measure_dispatch_cost(width=width, tokens=tokens)
        print(f"[dispatch] {name}: {dispatch.per_call_s * 1e6:.1f} us per SAC call at {width} x {tokens} (what "
              f"every call is charged); load {os.getloadavg()[0]:.2f}", flush=True)
        r = measure_model(name, model, spec, hardware, repeats, dispatch.per_call_s)
        r |= {"sac_per_call_s": dispatch.per_call_s, "sac_per_call_source": dispatch.source}
        rows.append(r)
        if "skipped" in r:
            print(f"[{name}] skipped: {r['skipped']}", flush=True)
            continue
        print(f"[{name}] {r['layer']}: {r['calls']} calls ({r['cached_calls']} cached, {r['executed_calls']} run "
              f"again, {r['view_calls']} views); the cached calls cost {r['cached_calls_cost_s'] * 1e6:.0f} us "
              f"(a call: {r['before_mode_median_s'] * 1e6:.1f} us before the mode, "
              f"{r['inside_mode_median_s'] * 1e6:.1f} us inside, medians), charged "
              f"{r['cached_calls_charged_s'] * 1e6:.0f} us: unpriced "
              f"{r['unpriced_per_cached_call_s'] * 1e6:+.1f} us a cached call. Check: the cache saves "
              f"{r['cache_saves_s'] * 1e6:.0f} us of the replay, priced {r['cached_ops_time_s'] * 1e6:.0f} us "
              f"({r['check_unpriced_per_cached_call_s'] * 1e6:+.1f} us a cached call); load {r['load']}", flush=True)
    result = {"machine_start": started, "machine_end": machine(), "torch_threads": 1, "rows": rows}
    print(f"[saved] {save_result('export_cached_calls.json', result)}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40, help="pairs of replays timed after 5 warm-up pairs")
    run(parser.parse_args().repeats)


if __name__ == "__main__":
    main()
