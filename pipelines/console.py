"""What a job prints: one line per job of a sweep, the full summary of a single run.

Every figure a run is judged by is on its line: throughput retained, tokens/s and MFU (model FLOPs,
`slackswap.experiment.throughput`), and, when the step does not fit the device, that verdict in
capitals beside the status. A run that meets its budget but not the device keeps the status `ok`
(the budget was met; MLflow shows it FINISHED) and never reads as a plain success
(docs/pipeline.md, "Device fit").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipelines.presentation import size_text
from pipelines.records import RunRecord


def device_verdict(metrics: Mapping[str, Any]) -> str:
    """"" when the step fits the device or there is no step to judge; otherwise why it does not."""
    if metrics.get("fits_device") is not False:
        return ""
    over = -(metrics.get("headroom_bytes") or 0)
    if not metrics.get("feasible"):
        return "DOES NOT FIT THE DEVICE"
    return (
        f"DOES NOT FIT THE DEVICE: peak {size_text(metrics.get('device_peak_activation_bytes'))} + static "
        f"{size_text(metrics.get('static_bytes'))} + reserve {size_text(metrics.get('reserve_bytes'))} "
        f"is {size_text(over)} over "
        f"{size_text(metrics.get('device_memory_bytes'))} of device memory"
    )


def speed(metrics: Mapping[str, Any]) -> str:
    """`12,345 tokens/s, MFU 41.2%` of a simulated step; `n/a` without one."""
    rate, mfu = metrics.get("tokens_per_s"), metrics.get("mfu")
    if rate is None or mfu is None:
        return "tokens/s n/a"
    return f"{rate:,.0f} tokens/s, MFU {mfu:.1%}"


def step_scope(resolved: Mapping[str, Any], m: Mapping[str, Any] | None = None) -> str:
    """What the simulated step, and so tokens/s and MFU, covers. A run simulates its graph: forward and
    backward, the optimizer step only with `model.include_optimizer=true`, and never the collectives of
    a ZeRO / data-parallel job, which `pipelines.advise` prices (docs/advise.md): without the clause one
    Llama-7B ZeRO-3 configuration read 4,178 tokens/s here and 3,935 from the advice. A one-stage tp /
    cp layout's step includes the exposed part of its collectives when the metrics `m` priced them."""
    with_optimizer = bool((resolved.get("model") or {}).get("include_optimizer"))
    training = resolved.get("training") or {}
    shards = training.get("zero_shards") or 1
    covered = "forward + backward" + (" + optimizer step" if with_optimizer else "")
    left = [] if with_optimizer else ["the optimizer step (model.include_optimizer=false)"]
    if isinstance(shards, int) and shards > 1:
        left.append(f"ZeRO-{training.get('zero_stage')}'s collectives over {shards} GPUs")
    layout = resolved.get("parallel") or {}
    split = (layout.get("tp") or 1) > 1 or (layout.get("cp") or 1) > 1
    exposed = None if m is None else m.get("layout_comm_s")
    if split and exposed is not None:
        covered += f" + the layout's exposed collectives ({1e3 * exposed:.2f} ms per micro-batch)"
    elif split:
        left.append("the layout's collectives (see the layout line)")
    if not left:
        return f"step: {covered}"
    # advise prices data-parallel steps of full replicas only, not a layout's
    tail = "" if split else "; pipelines.advise prices the whole step"
    return f"step: {covered}, without {' and '.join(left)}{tail}"


def layout_line(m: Mapping[str, Any]) -> str:
    """One rank's layout figures: degrees, the layer's saved bytes on this rank, the layout's collectives."""
    degrees = " ".join(f"{k}={m[f'parallel_{k}']}" for k in ("dp", "tp", "pp", "cp", "ep"))
    comm = f"{m['layout_collectives']} collectives, {size_text(m['layout_comm_bus_bytes'])} on the bus"
    if m.get("layout_comm_forward_s") is not None:
        where = ("per micro-batch, in each stage's forward and backward" if m.get("pipeline_microbatches")
                 else "in the step time")
        comm += (f", {1e3 * m['layout_comm_forward_s']:.2f} ms fwd + {1e3 * m['layout_comm_backward_s']:.2f} ms "
                 f"bwd on {m['layout_comm_fabric']}, {1e3 * m['layout_comm_s']:.2f} ms exposed ({where}; "
                 f"{1e3 * m['layout_comm_hidden_s']:.2f} ms hidden behind attention)")
    else:
        comm += f", time not priced: {m['layout_comm_unpriced']}"
    sp = str(m["parallel_sp"]).lower()
    return (f"layout       per rank of {m['parallel_world_size']} GPU(s) ({degrees} sp={sp}): "
            f"{size_text(m['rank_layer_saved_bytes'])} saved per layer; {comm}")


def pipeline_line(m: Mapping[str, Any]) -> str:
    """A pipeline's schedule, bubbles, sends and each stage's memory (stage 0 first), and its step's
    certified lower bound and gap when the planner gives one (planner=milp)."""
    bubble = m["pipeline_bubble_fraction"]
    bubble = "n/a" if bubble is None else f"{100 * bubble:.1f}%"
    p2p = (f"{1e3 * m['pipeline_p2p_s']:.3f} ms per send" if m["pipeline_p2p_unpriced"] is None
           else f"sends not priced: {m['pipeline_p2p_unpriced']}")
    chunks = m.get("pipeline_virtual_stages") or 1
    schedule = m["pipeline_schedule"] + (f" ({chunks} chunks per stage)" if chunks > 1 else "")
    bound = ""
    if m.get("bound_step_s") is not None and m.get("optimality_gap") is not None:
        bound = (f"; step bound {m['bound_step_s']:.6f} s (gap {100 * m['optimality_gap']:+.2f}%; per stage and "
                 f"micro-batch {m['pipeline_bound_s_by_stage']} s)")
    return (f"pipeline     {schedule}, {m['pipeline_microbatches']} micro-batches, bubble {bubble} "
            f"(keep-all {100 * m['pipeline_ideal_bubble_fraction']:.1f}%), {p2p}; per stage: in flight "
            f"{m['pipeline_in_flight_by_stage']}, peak bytes {m['pipeline_peak_bytes_by_stage']} of budget "
            f"{m['pipeline_budget_bytes_by_stage']}{bound}")


def format_one_line(record: RunRecord) -> str:
    m = record.metrics
    ratio = m.get("throughput_ratio")
    shown = f"{ratio:.1%}" if isinstance(ratio, (int, float)) else "n/a"
    tail = f"  ({record.failure_reason})" if record.failure_reason else ""
    verdict = device_verdict(m)
    if verdict and record.status == "ok":
        tail += f"  ({verdict.split(':')[0]}: {size_text(-(m.get('headroom_bytes') or 0))} over)"
    return f"[{record.status:>10}] {record.run_name}: throughput retained {shown}, {speed(m)}{tail}"


def format_summary(record: RunRecord, resolved: Mapping[str, Any]) -> str:
    m = record.metrics
    facts = record.facts
    ratio = m.get("throughput_ratio")
    lines = [
        f"model        {record.model} ({resolved['model']['name']})",
        f"hardware     {record.hardware} ({resolved['hardware']['name']}, "
        f"link {resolved['hardware']['link']['name']})",
        f"budget       {size_text(m.get('budget_bytes'))} "
        f"(fraction={resolved['budget']['fraction']}, bytes={resolved['budget']['bytes']}"
        f"{', device' if resolved['budget'].get('device') else ''}) "
        f"of keep-all peak {size_text(m.get('keep_all_peak_bytes'))}",
        f"planner      {record.planner} ({record.planner_name})",
    ]
    if m.get("effective_h2d_gbps") is not None:
        node = resolved["node"]
        lines.append(
            f"node         {node['name']}: {node['gpus_per_node']} GPU(s), {node['gpus_per_pcie_switch']} per "
            f"switch; each GPU gets H2D {m['effective_h2d_gbps']:.2f} GB/s ({m['h2d_limit']}), "
            f"D2H {m['effective_d2h_gbps']:.2f} GB/s ({m['d2h_limit']})"
        )
    # A traced preset's node, or profile=torch's options (no builder: the family's transformers class).
    profile = resolved.get("profile") or {}
    torch_node = resolved["model"].get("torch") or (
        profile.get("options") if profile.get("source") == "torch" else None
    ) or {}  # fmt: skip
    if torch_node or m.get("analytic_keep_all_peak_bytes") is not None:
        builder = torch_node.get("builder", resolved["model"]["family"])
        what = (f"hook {torch_node['hook']}" if builder == "hook" else
                f"hf {torch_node['config_class']}" if builder == "hf" else builder)
        line = (
            f"profile      traced {what} ({torch_node.get('attention', 'default')} attention, "
            f"{torch_node.get('semantics', 'default')} kernels): "
            f"real keep-all peak {size_text(m.get('keep_all_peak_bytes'))}"
        )
        # Only like with like: the analytic graph of the same shape and attention (none for a hook model).
        if m.get("analytic_keep_all_peak_bytes") is not None:
            line += (
                f" vs analytic {size_text(m['analytic_keep_all_peak_bytes'])} "
                f"({m['real_to_analytic_peak_ratio']:.3f}x)"
            )
        lines.append(line)
    if m.get("parallel_world_size") is not None:
        lines.append(layout_line(m))
    if m.get("pipeline_schedule") is not None:
        lines.append(pipeline_line(m))
    verdict = device_verdict(m)
    lines += [
        f"status       {record.status}" + (f": {record.failure_reason}" if record.failure_reason else "")
        + (f"; {verdict}" if verdict else ""),
    ]
    if ratio is not None:
        lines += [
            f"throughput   {ratio:.2%} of ideal",
            f"step time    {m.get('step_s', float('nan')):.4f} s (ideal {m.get('ideal_step_s', float('nan')):.4f} s)",
            f"speed        {speed(m)} per GPU ({step_scope(resolved, m)}; {m.get('tokens_per_step')} tokens per "
            f"step; {m.get('model_flops', float('nan')):.4g} model FLOPs: {m.get('model_flops_source')})",
            f"peak memory  {size_text(m.get('peak_activation_bytes'))} of budget {size_text(m.get('budget_bytes'))}"
            + (
                f"; caching allocator reserves {size_text(m['peak_reserved_bytes'])} "
                f"({'fits' if m.get('fits_reserved') else 'over budget'}, "
                f"{m['fragmentation_share']:.1%} fragmentation)"
                if m.get("peak_reserved_bytes") is not None
                else ""
            ),
            f"swapped      {m.get('swapped_tensors')} tensors, {size_text(m.get('d2h_bytes'))} d2h, "
            f"{size_text(m.get('h2d_bytes'))} h2d, stall {m.get('stall_s', float('nan')):.4f} s",
            f"recomputed   {m.get('recomputed_tensors')} tensors, "
            f"{m.get('recompute_s', float('nan')):.4f} s extra compute",
        ]
        for key in ("swapped", "recomputed"):
            names = facts.get(key) or ()
            if names:
                shown = ", ".join(names[:6]) + (f", ... (+{len(names) - 6})" if len(names) > 6 else "")
                lines.append(f"  {key}: {shown}")
    if m.get("static_bytes") is not None:
        training = resolved.get("training") or {}
        lines.append(
            f"device       static {size_text(m['static_bytes'])} per GPU ({training.get('optimizer')} "
            f"{training.get('precision')}, ZeRO-{training.get('zero_stage')} x {training.get('zero_shards')}), "
            f"reserve {size_text(m.get('reserve_bytes'))}, headroom {size_text(m.get('headroom_bytes'))} "
            f"of {size_text(m.get('device_memory_bytes'))}"
            + ("" if m.get("fits_device") is not False else " (does not fit)")
        )
    lines.append(f"run dir      {record.run_dir}")
    if record.mlflow_run_id:
        lines.append(f"mlflow run   {record.mlflow_run_id} ({resolved['tracking']['uri']})")
    return "\n".join(lines)
