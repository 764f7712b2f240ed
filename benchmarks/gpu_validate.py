"""Run plans for real and compare with the simulator: measured vs simulated step time and peak.

    python benchmarks/gpu_validate.py                 # CUDA: BERT-Large, GPT-2 XL, Llama-7B shapes (< 5 min, H200)
    python benchmarks/gpu_validate.py --device cpu    # the CPU path: 2-layer toy shapes of the same families

Per model: the preset's real torch model (hf_bert_large, hf_gpt2_xl, hf_llama7b; `--layers` layers, as
many as fit comfortably in one H200 next to their weights and gradients) is captured on the device
(`slackswap.runtime.capture_graph`, timed with the roofline on the `h200_sxm_pcie5` preset). A plain
keep-all step measures the activation peak; the budget is 50 % of it. keep_all (no budget) and
slackswap, capuchin, recompute_knapsack at that budget are then each run for real: one warm-up and
`--steps` timed forward+backward steps under the plan, and one step against a plain one for the
gradient check. Measured: median step time; peak activation memory = max_memory_allocated over the
step minus what was allocated when it started (weights; gradients are set to None before each step,
so weight gradients made in backward are included) on CUDA; on the CPU the runtime's ledger of every
device storage of a graph tensor, against `simulate` of the plan on the CPU's instant link (the two
are equal to the byte, docs/runtime.md), at 70 % of the simulated keep-all peak (the 2-layer toys'
own holds, `Tensor.held_until`, put 50 % out of every planner's reach). Simulated: `simulate` on
h200_sxm_pcie5 under the same budget. Ratios are measured / simulated. An
infeasible plan is a row with its reason. Writes benchmarks/results/gpu_validate[_cpu].json and prints
the table (markdown).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PRESETS = {"bert": ("hf_bert_large", 24), "gpt2": ("hf_gpt2_xl", 12), "llama": ("hf_llama7b", 6)}
PLANNERS = ("keep_all", "slackswap", "capuchin", "recompute_knapsack")
BUDGET_FRACTION = 0.5
#: The CPU path's toy models: with eager lifetimes counted (Tensor.held_until) no planner meets 50 % of
#: their keep-all peaks; 70 %, as the runtime tests plan them.
CPU_BUDGET_FRACTION = 0.7


def load_preset(preset: str, layers: int):
    """ModelConfig and TorchSpec of a conf/model preset (Hydra composition), with `layers` layers."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import pipelines.schemas  # noqa: F401
    from pipelines.hydra_versions import MAIN_VERSION
    from slackswap.model_config import ModelConfig
    from slackswap.profile.torch.spec import TorchSpec

    with initialize_config_dir(str(REPO / "conf"), **MAIN_VERSION):
        cfg = compose("train", overrides=[f"model={preset}", f"model.num_layers={layers}", "tracking=off"])
    node = OmegaConf.to_container(cfg.model, resolve=True)
    spec = node.pop("torch")
    return ModelConfig.from_dict(node), TorchSpec.from_dict(spec)


def hardware():
    from slackswap.hardware import load_preset

    return load_preset("h200_sxm_pcie5")


def measure(w, graph, plan, device, steps: int) -> dict:
    """Median step time and peak activation bytes over `steps` steps after one warm-up."""
    import torch

    from slackswap.runtime import apply

    run = None if plan is None else apply(plan, graph, w.model)
    times, peaks, ledgers = [], [], []
    for i in range(steps + 1):
        for p in w.model.parameters():
            p.grad = None
        torch.manual_seed(1)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start_bytes = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        if run is None:
            w.loss_fn(w.model(w.batch)).backward()
        else:
            with run:
                w.loss_fn(w.model(w.batch)).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if i == 0:
            # The first step under a run is the verified one (dispatch modes, ledgers measured); the
            # timed steps after it run on the saved-tensor hooks alone and measure no ledger.
            ledger = run.report.ledger_peak_bytes if run is not None else 0
            device_peak = run.report.device_peak_bytes if run is not None else 0
            ledgers.append(ledger)
            continue
        peak = torch.cuda.max_memory_allocated() - start_bytes if device == "cuda" else device_peak
        times.append(elapsed)
        peaks.append(peak)
    for p in w.model.parameters():
        p.grad = None
    return {"measured_step_s": statistics.median(times), "measured_peak_bytes": max(peaks),
            "ledger_peak_bytes": max(ledgers)}


def measure_export(w, graph, plan, device, steps: int, export=None, backend: object = "inductor") -> dict:
    """The plan exported to PyTorch (per-layer selective checkpointing, each layer torch.compile'd):
    median step time after a warm-up step (which compiles, unless `export` was already compiled with
    `backend`: its compiled layers are reused); on CUDA the allocator's peak."""
    import torch

    from slackswap.runtime.export import PlanExport

    export = export or PlanExport(plan, graph, w.model)
    times, peaks = [], []
    with export.installed(w.model, compile=True, backend=backend):
        for i in range(steps + 1):
            for p in w.model.parameters():
                p.grad = None
            torch.manual_seed(1)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start_bytes = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            w.loss_fn(w.model(w.batch)).backward()
            if device == "cuda":
                torch.cuda.synchronize()
            if i > 0:
                times.append(time.perf_counter() - t0)
                if device == "cuda":
                    peaks.append(torch.cuda.max_memory_allocated() - start_bytes)
    for p in w.model.parameters():
        p.grad = None
    return {"measured_step_s": statistics.median(times), "measured_peak_bytes": max(peaks) if peaks else None}


def export_row(w, graph, plan, device: str, steps: int, row: dict, hw) -> dict:
    """The export's row: measured compiled steps against the simulator's price of the plan as PyTorch
    executes it (`slackswap.pytorch_execution`, compiled placement, the decisions it really runs), on
    `graph`, the graph the plan was made on (`export_plan_graph(..., compile=True)`)."""
    from slackswap.pytorch_execution import pytorch_plan
    from slackswap.runtime.export import PlanExport, differences_by_reason
    from slackswap.runtime.export_graph import EXPORT_EXECUTOR, priced_for
    from slackswap.runtime.train import compiled_gradient_check
    from slackswap.simulate import simulate

    # The gradient check compiles the layers; the timed steps reuse that compiled code (one compile).
    check = compiled_gradient_check(w, graph, plan)
    measured = measure_export(w, graph, plan, device, steps, check.export, check.backend)
    # One eager step: the decisions PyTorch executes (the same decisions, priced for eager: the pricing
    # changes bytes, not decisions, and a plan priced for compile is not installed eagerly).
    export = PlanExport(priced_for(plan, compile=False), graph, w.model)
    with export.installed(w.model):
        w.loss_fn(w.model(w.batch)).backward()
    for p in w.model.parameters():
        p.grad = None
    executed = pytorch_plan(graph, plan, export.effective_decisions(), hw, "compiled")
    sim = simulate(graph, executed, hw, None)
    out = {**row, "executor": "export_compiled", "status": "ok", **measured, "sim_step_s": sim.step_s,
           "sim_peak_activation_bytes": sim.peak_activation_bytes, "grad_bit_exact": check.bit_exact,
           "grad_max_abs_diff": check.max_abs_diff, "export_differences": len(check.differences),
           # By the reason's first clause (slackswap.runtime.export): for a plan made for the compiled export
           # the layers' outputs held outside the partition, no tensor saved with other bytes than planned.
           "export_differences_by_reason": differences_by_reason(check.differences),
           "plan_export_executor": plan.notes.get(EXPORT_EXECUTOR)}
    out["step_ratio"] = out["measured_step_s"] / sim.step_s if sim.step_s else None
    out["peak_ratio"] = (out["measured_peak_bytes"] / sim.peak_activation_bytes
                         if out["measured_peak_bytes"] is not None else None)
    return out


def validate_model(kind: str, device: str, layers: int | None, steps: int, small: bool,
                   export: tuple[str, ...] = ()) -> list[dict]:
    import torch

    from slackswap.errors import InfeasibleBudgetError
    from slackswap.experiment.export_plan import export_plan_graph, plan_for_export
    from slackswap.planners.registry import get_planner
    from slackswap.runtime import capture_graph, plan_counts
    from slackswap.runtime.train import gradient_check
    from slackswap.runtime.training_workload import build_training_workload, small_config
    from slackswap.simulate import simulate
    from slackswap.simulate.saved_peak import instant_link, simulated_saved_peak_bytes

    hw = hardware()
    if small:
        model, spec = small_config(kind)
    else:
        preset, default_layers = PRESETS[kind]
        model, spec = load_preset(preset, layers or default_layers)
    w = build_training_workload(model, spec, device, seed=0)
    t0 = time.perf_counter()
    graph = capture_graph(w.model, (w.batch,), w.loss_fn, hw, f"{model.name}@{hw.name}")
    capture_s = time.perf_counter() - t0
    for p in w.model.parameters():
        p.grad = None
    plain = measure(w, graph, None, device, steps)
    if device == "cuda":
        budget = int(plain["measured_peak_bytes"] * BUDGET_FRACTION)
    else:  # no allocator to ask on the CPU: 70 % of the simulated keep-all activation peak instead
        from slackswap.simulate.metrics import simulate_ideal

        budget = int(simulate_ideal(graph, hw).peak_activation_bytes * CPU_BUDGET_FRACTION)
    rows = []
    for name in PLANNERS:
        row = {"model": model.name, "layers": model.num_layers, "planner": name, "device": device,
               "budget_bytes": None if name == "keep_all" else budget, "capture_s": capture_s, "executor": "eager"}
        print(f"[gpu_validate] {model.name} ({model.num_layers} layers) {name} ...", flush=True)
        try:
            plan = get_planner(name).plan(graph, hw, row["budget_bytes"])
        except InfeasibleBudgetError as exc:
            rows.append({**row, "status": "infeasible", "reason": str(exc)})
            continue
        sim = simulate(graph, plan, hw, row["budget_bytes"])
        measured = measure(w, graph, plan, device, steps)
        check = gradient_check(w, graph, plan)
        row.update(status="ok", **measured, **plan_counts(plan),
                   sim_step_s=sim.step_s, sim_peak_activation_bytes=sim.peak_activation_bytes,
                   sim_saved_peak_bytes=simulated_saved_peak_bytes(graph, plan, hw),
                   sim_peak_device_link_bytes=simulate(graph, plan, instant_link(hw), None).peak_activation_bytes
                   if device == "cpu" else sim.peak_activation_bytes,
                   grad_bit_exact=check.bit_exact, grad_max_abs_diff=check.max_abs_diff,
                   plain_step_s=plain["measured_step_s"], plain_peak_bytes=plain["measured_peak_bytes"])
        row["step_ratio"] = row["measured_step_s"] / sim.step_s if sim.step_s else None
        # CUDA: the allocator's peak against every simulated activation byte; CPU: the ledger of every
        # device storage against the simulation on the CPU's instant link.
        row["peak_ratio"] = row["measured_peak_bytes"] / sim_peak(row)
        rows.append(row)
        if name in export:
            print(f"[gpu_validate] {model.name} {name}: the export, compiled ...", flush=True)
            base = {k: row[k] for k in ("model", "layers", "planner", "device", "budget_bytes", "capture_s")}
            # The plan made for the compiled export (inside PyTorch's plan space, priced as the compiled
            # step stores it: a CPU dropout's mask bool), so it runs as planned and the simulator prices it
            # on that graph.
            try:
                exported = plan_for_export(get_planner(name), graph, w.model, hw, row["budget_bytes"], compile=True)
            except InfeasibleBudgetError as exc:
                rows.append({**base, "executor": "export_compiled", "status": "infeasible", "reason": str(exc)})
                continue
            rows.append(export_row(w, export_plan_graph(graph, w.model, compile=True), exported, device, steps,
                                   base, hw))
    del w
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def sim_peak(row: dict) -> int:
    return row["sim_peak_device_link_bytes"]


def table(rows: list[dict]) -> str:
    """Markdown; on the CPU the peaks are every graph tensor's storage (ledger vs the instant-link
    simulation), on CUDA max_memory_allocated less the weights vs the simulation under the budget."""
    lines = ["| model | layers | planner | budget MiB | measured step ms | sim step ms | step ratio | "
             "measured peak MiB | sim peak MiB | peak ratio | grads exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    mib = 2**20
    for r in rows:
        budget = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / mib:.1f}"
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['layers']} | {r['planner']} | {budget} | infeasible: "
                         f"{r['reason'][:80]} |||||||")
            continue
        if r.get("executor") == "export_compiled":
            peak = "-" if r["measured_peak_bytes"] is None else f"{r['measured_peak_bytes'] / mib:.3f}"
            ratio = "-" if r["peak_ratio"] is None else f"{r['peak_ratio']:.2f}"
            lines.append(
                f"| {r['model']} | {r['layers']} | {r['planner']} (export, compiled) | {budget} | "
                f"{r['measured_step_s'] * 1e3:.2f} | {r['sim_step_s'] * 1e3:.2f} | {r['step_ratio']:.2f} | {peak} | "
                f"{r['sim_peak_activation_bytes'] / mib:.3f} | {ratio} | max diff {r['grad_max_abs_diff']:.2g} |")
            continue
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['planner']} | {budget} | {r['measured_step_s'] * 1e3:.2f} | "
            f"{r['sim_step_s'] * 1e3:.2f} | {r['step_ratio']:.2f} | {r['measured_peak_bytes'] / mib:.3f} | "
            f"{sim_peak(r) / mib:.3f} | {r['peak_ratio']:.2f} | {r['grad_bit_exact']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=None, help="layers per model (default: per-model fit)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan (after one warm-up)")
    parser.add_argument("--models", default="bert,gpt2,llama")
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default benchmarks/results/...)")
    parser.add_argument("--export", default=None,
                        help="planners whose plan also runs exported to PyTorch, compiled (default: slackswap on "
                             "CUDA, none on the CPU); comma-separated, '' for none")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible (use --device cpu for the CPU path)")
    small = args.device == "cpu"  # the CPU path runs the same families at toy sizes
    threads = torch.get_num_threads()
    if small:
        torch.set_num_threads(1)  # the caller's setting is given back below (main runs inside tests too)
    t0 = time.perf_counter()
    rows = []
    export = args.export if args.export is not None else ("slackswap" if args.device == "cuda" else "")
    try:
        for kind in args.models.split(","):
            rows += validate_model(kind, args.device, args.layers, args.steps, small,
                                   tuple(p for p in export.split(",") if p))
    finally:
        torch.set_num_threads(threads)
    out = args.out or REPO / "benchmarks" / "results" / f"gpu_validate{'_cpu' if small else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out.write_text(json.dumps({"device": device_name, "wall_s": time.perf_counter() - t0, "rows": rows}, indent=2))
    print(table(rows))
    print(f"[gpu_validate] {len(rows)} rows in {time.perf_counter() - t0:.1f} s -> {out}")
    return rows


if __name__ == "__main__":
    main()
