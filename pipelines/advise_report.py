"""What `pipelines.advise` writes: the printed summary, advice.json / advice.md, and the MLflow parent
run with a child per answer row. No modelling: the inputs are `slackswap.experiment.advise_spec`'s and
the search is `slackswap.experiment.advise`'s."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines import faults, presentation, tracking
from pipelines.records import RunStatus

if TYPE_CHECKING:
    from slackswap.experiment.advise_spec import AdviseSpec

GIB = 2**30
ADVICE_SCHEMA = "slackswap-advice/1"


# --- printing ---------------------------------------------------------------------------------------


def _gib(n: Any) -> str:
    return "-" if n is None else f"{n / GIB:.1f}"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


TABLE_HEADER = (
    "| # | GPUs | layout | recipe | mb | planner | against | tokens/s/GPU | MFU | step s | peak GiB | headroom GiB "
    "| fits | comm exposed s | bound | communication (model) | same result with |"
)


def _table_row(rank: Any, advice: Any, i: int) -> str:
    from slackswap.experiment.advise import ties

    r = advice.rows[i]
    c = r.candidate
    same = [t for t in ties(advice, i) if t != f"{c.planner}/{c.plan_against}"]
    comm = "-" if r.comm is None else f"{r.comm.fabric}: {r.comm.assumption}"
    return (
        f"| {rank} | {c.layout.gpus} | {c.layout.label} | {c.recipe} | {c.micro_batch} | {c.planner} | "
        f"{c.plan_against} | {_num(r.tokens_per_s, ',.0f')} | {_num(r.mfu, '.1%')} | {_num(r.step_s, '.4g')} | "
        f"{_gib(r.peak_bytes)} | {_gib(r.headroom_bytes)} | {'yes' if r.fits_device else 'no'} | "
        f"{_num(r.comm_exposed_s, '.3f')} | {r.bound or '-'} | {comm} | {', '.join(same) or '-'} |"
    )


def _best_description(r: Any) -> str:
    """A best row's speed, memory and choices, as both the summary and stdout give them."""
    c = r.candidate
    return (f"MFU {r.mfu:.1%}, step {r.step_s:.4g} s: {c.layout.label}, {c.recipe}, micro-batch {c.micro_batch}, "
            f"planner {c.planner} (plan against {c.plan_against}); peak {r.peak_bytes / GIB:.1f} GiB, headroom "
            f"{r.headroom_bytes / GIB:.1f} GiB")


def _chunk_list(chunks: tuple[int, ...], virtual_stages: int) -> str:
    """" (chunks 0, 4)" for a device of an interleaved layout, "" under 1F1B (the stage is its chunk)."""
    return f" (chunks {', '.join(map(str, chunks))})" if virtual_stages > 1 else ""


def layout_lines(r: Any, indent: str = "    ") -> list[str]:
    """The answer's layout and its per-stage plans (one stage, the whole model, for a data-parallel row)."""
    c = r.candidate
    lay = c.layout
    chunks = f" with {lay.virtual_stages} chunks per stage" if lay.virtual_stages > 1 else ""
    sched = f"{lay.microbatches} micro-batches per pipeline, schedule {lay.schedule}{chunks}" if lay.pp > 1 else \
        "no pipeline"
    out = [f"{indent}layout: dp {lay.dp}, tp {lay.tp}{' (sp)' if lay.sp else ''}, pp {lay.pp}, cp {lay.cp}, "
           f"{f'ep {lay.ep}, ' if lay.ep > 1 else ''}"
           f"ZeRO-{lay.zero_stage} over {lay.zero_shards}, micro-batch {c.micro_batch}, {sched}"]
    if r.stages:
        held = "micro-batch chunks" if lay.virtual_stages > 1 else "micro-batches"
        out += [f"{indent}  stage {p.stage}{_chunk_list(p.chunks, lay.virtual_stages)}: planner {p.planner}, "
                f"{p.in_flight} {held} in flight, budget "
                f"{p.budget_bytes / GIB:.1f} GiB, peak {p.peak_bytes / GIB:.1f} GiB "
                f"(static {p.static_bytes / GIB:.1f}), "
                f"forward {p.forward_s:.3f} s, backward {p.backward_s:.3f} s" for p in r.stages]
        out.append(f"{indent}  tp/cp/ep collectives {r.layout_comm_s:.3f} s per step on the critical path; "
                   f"{r.layout_note}")
    else:
        out.append(f"{indent}  stage 0 (the whole model): planner {c.planner}, budget "
                   f"{r.activation_capacity_bytes / GIB:.1f} GiB, peak {r.peak_bytes / GIB:.1f} GiB "
                   f"(static {r.static_bytes / GIB:.1f})")
    return out


def numerics_lines(advice: Any, gpus: int, indent: str = "    ") -> list[str]:
    """Beside an answer whose recipe changes the numerics: what changes, and the best that does not."""
    r = advice.best_rows().get(gpus)
    if r is None or not r.numerics:
        return []
    out = [f"{indent}NOTE: {r.candidate.recipe} changes the training's numerics: {r.numerics}"]
    i = advice.best_faithful.get(gpus)
    if i is None:
        return out + [f"{indent}no configuration that keeps the numerics (mixed precision) fits"]
    f = advice.rows[i]
    gap = (r.tokens_per_s - f.tokens_per_s) / f.tokens_per_s
    return out + [f"{indent}best keeping the numerics: {f.tokens_per_s:,.0f} tokens/s per GPU ({gap:.1%} slower), "
                  f"{_best_description(f)}", *layout_lines(f, indent + "  ")]


def summary_markdown(advice: Any, spec: AdviseSpec, header: Mapping[str, Any]) -> str:
    """advice.md: the answer per GPU count, the ranked table, the best per recipe, the rejected regions."""
    from slackswap.communication import not_modelled
    from slackswap.experiment.advise import distinct_ranked

    m, hw = spec.model, spec.hardware
    lines = [f"# advise: {m.name} on {header['hardware']} ({hw.device_memory_bytes / GIB:.0f} GiB), node "
             f"{header['node']}, seq {m.seq_len}", ""]
    lines += [f"- {n}" for n in spec.notes]
    lines += [f"- communication not modelled: {not_modelled(hw.collective_overlap_slowdown)}",
              f"- {len(advice.rows)} configurations evaluated, {advice.pruned_configurations} pruned before planning",
              ""]
    lines += ["## Best fitting configuration per GPU count", ""]
    for gpus in spec.space.gpus:
        r = advice.best_rows().get(gpus)
        if r is None:
            lines.append(f"- **{gpus} GPU(s)**: nothing fits (see the rejected regions)")
            continue
        lines.append(
            f"- **{gpus} GPU(s)**: {r.tokens_per_s:,.0f} tokens/s per GPU ({r.tokens_per_s * gpus:,.0f} in all), "
            f"{_best_description(r)}. Why: {r.why}"
        )
        lines += [f"  - {x.strip()}" for x in layout_lines(r) + numerics_lines(advice, gpus)]
    lines += ["", f"## Top {spec.top} (fitting, by tokens/s per GPU)", "", TABLE_HEADER, _separator()]
    for k, i in enumerate(distinct_ranked(advice)[: spec.top], start=1):
        lines.append(_table_row(k, advice, i))
    lines += ["", "## Best per GPU count and recipe", "", TABLE_HEADER, _separator()]
    seen = set()
    for i in advice.ranked:
        r = advice.rows[i]
        key = (r.candidate.layout.gpus, r.candidate.recipe)
        if key not in seen:
            seen.add(key)
            lines.append(_table_row(advice.ranked.index(i) + 1, advice, i))
    lines += ["", "## Rejected regions", "", "| reason | where | configurations | detail |", "|---|---|---|---|"]
    for g in advice.regions:
        where = ", ".join(f"{k}={v}" for k, v in g.choices.items() if k != "layout")
        lines.append(f"| {g.reason} | {g.choices.get('layout', '')}: {where} | {g.configurations} | {g.detail} |")
    infeasible = [r for r in advice.rows if not r.fits_device]
    lines += ["", f"{len(infeasible)} evaluated configurations do not fit the device (planner or allocator): "
              "rows with fits_device false in advice.json give each reason.", ""]
    return "\n".join(lines) + "\n"


def _separator() -> str:
    return "|" + "---|" * (TABLE_HEADER.count("|") - 1)


def stdout_summary(advice: Any, spec: AdviseSpec, header: Mapping[str, Any], wall_s: float) -> str:
    from slackswap.experiment.advise import distinct_ranked

    lines = ["", f"advise: {spec.model.name} on {header['hardware']}, node {header['node']}: "
             f"{len(advice.rows)} configurations evaluated in {wall_s:.1f} s, {advice.pruned_configurations} pruned"]
    lines += [f"  note: {n}" for n in spec.notes]
    for gpus in spec.space.gpus:
        r = advice.best_rows().get(gpus)
        if r is None:
            lines.append(f"best on {gpus} GPU(s): nothing fits")
            continue
        lines.append(f"best on {gpus} GPU(s): {r.tokens_per_s:,.0f} tokens/s per GPU, {_best_description(r)}")
        lines += layout_lines(r)
        lines.append(f"    why: {r.why}")
        lines += numerics_lines(advice, gpus)
    lines += ["", TABLE_HEADER, _separator()]
    lines += [_table_row(k, advice, i) for k, i in enumerate(distinct_ranked(advice)[: spec.top], start=1)]
    lines += ["", "best per recipe:"]
    seen = set()
    for i in advice.ranked:
        r = advice.rows[i]
        key = (r.candidate.layout.gpus, r.candidate.recipe)
        if key not in seen:
            seen.add(key)
            c = r.candidate
            lines.append(f"  {c.layout.gpus} GPU(s), {c.recipe}: {r.tokens_per_s:,.0f} tokens/s per GPU, MFU "
                         f"{r.mfu:.1%}: {c.layout.label}, micro-batch {c.micro_batch}, {c.planner}/{c.plan_against}, "
                         f"peak {r.peak_bytes / GIB:.1f} GiB")
    lines.append("")
    lines.append("rejected regions:")
    for g in advice.regions:
        lines.append(f"  {g.reason}: {g.choices.get('layout', '')} {g.choices.get('recipe', '')} "
                     f"({g.configurations} configurations): {g.detail}")
    return "\n".join(lines)


def advice_json(advice: Any, spec: AdviseSpec, header: Mapping[str, Any]) -> dict[str, Any]:
    from slackswap.communication import not_modelled

    space = spec.space
    return {
        "schema": ADVICE_SCHEMA,
        **header,
        "notes": list(spec.notes),
        "communication_not_modelled": not_modelled(spec.hardware.collective_overlap_slowdown),
        "space": {"gpus": list(space.gpus), "recipes": list(space.recipes), "micro_batches": list(space.micro_batches),
                  "planners": list(space.planners), "plan_against": list(space.plan_against),
                  "zero_stages": list(space.zero_stages), "grad_accum": space.grad_accum,
                  "milp_top_k": space.milp_top_k, "reserve_bytes": space.reserve_bytes, "graph": spec.graph,
                  "margin_bytes": space.margin_bytes, "tp": list(space.tp), "pp": list(space.pp), "cp": list(space.cp),
                  "sp": space.sp, "pipeline_microbatches": list(space.pipeline_microbatches),
                  "pipeline_schedule": list(space.pipeline_schedule), "virtual_stages": list(space.virtual_stages),
                  "layout_top_n": space.layout_top_n},
        "evaluated": len(advice.rows),
        "pruned": advice.pruned_configurations,
        "best": {str(g): i for g, i in advice.best.items()},
        "best_faithful": {str(g): i for g, i in advice.best_faithful.items()},
        "ranked": list(advice.ranked),
        "rows": [r.to_json() for r in advice.rows],
        "rejected_regions": [g.to_json() for g in advice.regions],
    }


# --- MLflow -----------------------------------------------------------------------------------------


def _child_metrics(row_json: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("tokens_per_s", "mfu", "step_s", "micro_step_s", "optimizer_s", "comm_total_s", "comm_exposed_s",
            "peak_bytes", "headroom_bytes", "static_bytes", "activation_capacity_bytes", "peak_activation_bytes",
            "peak_reserved_bytes", "swapped_tensors", "recomputed_tensors", "recompute_s", "stall_s",
            "model_flops_per_step")
    out = {k: row_json[k] for k in keys}
    out["fits_device"] = 1.0 if row_json["fits_device"] else 0.0
    return presentation.with_units(out)


def answer_rows(data: Mapping[str, Any]) -> list[int]:
    """The configurations that answer the question, in rank order: the best per GPU count and recipe
    (the first of them per GPU count is the answer printed for that count)."""
    seen: set[tuple[Any, Any]] = set()
    chosen = []
    for i in data["ranked"]:
        row = data["rows"][i]
        key = (row["gpus"], row["recipe"])
        if key not in seen:
            seen.add(key)
            chosen.append(i)
    return chosen


def _children(parent_id: str, data: Mapping[str, Any]) -> list[tuple[str, dict, dict, dict]]:
    """(name, tags, params, metrics) of each child run: one per answer row (`answer_rows`)."""
    provenance = tracking.provenance_tags("pipelines/advise.py")
    out = []
    for i in answer_rows(data):
        row = data["rows"][i]
        name = (f"{row['planner']} · {row['layout']} · {row['recipe']} · mb {row['micro_batch']} · "
                f"{row['plan_against']}")
        tags = {tracking.RUN_NAME_TAG: name, tracking.PARENT_RUN_TAG: parent_id, **provenance,
                "status": "ok" if row["fits_device"] else "infeasible", "fits_device": str(row["fits_device"]).lower(),
                "bound": row["bound"] or "-", "reason": (row["reason"] or "")[:4000],
                "comm_assumption": row["comm_assumption"] or "-", "comm_not_modelled": row["comm_not_modelled"],
                tracking.NOTE_TAG: f"configuration {i + 1} of the advise; {row['why'] or row['reason'] or ''}"[:4000]}
        params = {k: str(row[k]) for k in ("gpus", "zero_stage", "zero_shards", "layout", "recipe", "micro_batch",
                                           "planner", "plan_against", "dp", "tp", "pp", "cp", "sp",
                                           "pipeline_microbatches", "pipeline_schedule", "virtual_stages")}
        out.append((name, tags, params, tracking.numeric_metrics(_child_metrics(row))))
    return out


def log_configurations(client, experiment_id: str, parent_id: str, data: Mapping[str, Any]) -> tuple[int, float]:
    """One FINISHED child run per answer row (`answer_rows`), through MLflow's public client; every
    evaluated configuration is in the parent's `advice.json` artifact (its `rows`). Returns (children,
    seconds spent).

    Why not a child per configuration: MLflow has no bulk run creation, and a child costs three store
    transactions through the client (50-150 ms on a busy 2-core machine, minutes for the thousand
    configurations of a 7B advise); writing MLflow's SQL tables directly is faster but a private API
    that breaks when MLflow moves."""
    from mlflow.entities import Metric, Param

    t0 = time.perf_counter()
    children = _children(parent_id, data)
    now_ms = int(time.time() * 1000)
    for name, tags, params, metrics in children:
        info = client.create_run(experiment_id, tags=tags, run_name=name).info
        faults.track_in_flight(client, info.run_id)
        client.log_batch(info.run_id, metrics=[Metric(k, v, now_ms, 0) for k, v in metrics.items()],
                         params=[Param(k, v) for k, v in params.items()])
        client.set_terminated(info.run_id, status=tracking.MLFLOW_STATUS[RunStatus.OK])
        faults.done_in_flight(info.run_id)
    return len(children), time.perf_counter() - t0


def start_parent(track: Mapping[str, Any], name: str, params: Mapping[str, str]):
    client = tracking.open_client(track["uri"])
    experiment_id = tracking.ensure_experiment(client, track["experiment"], track["artifact_location"])
    info = tracking.create_run(client, experiment_id, name, {"kind": "advise"}, None, "pipelines/advise.py")
    faults.track_in_flight(client, info.run_id)
    tracking.log_params(client, info.run_id, params)
    return client, experiment_id, info


def finish_parent(client, info, track: Mapping[str, Any], run_dir: Path, metrics: Mapping[str, Any],
                  description: str) -> None:
    tracking.log_results(client, info.run_id, metrics, {tracking.NOTE_TAG: description[:4000], "status": "ok"})
    tracking.store_artifacts(client, info.run_id, [p for p in sorted(run_dir.iterdir()) if p.is_file()],
                             track.get("artifact_location"), info.artifact_uri)
    tracking.end_run(client, info.run_id, RunStatus.OK)
    faults.done_in_flight(info.run_id)


def parent_metrics(advice: Any, wall_s: float, mlflow_children_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"configurations_evaluated": len(advice.rows),
                           "configurations_pruned": advice.pruned_configurations,
                           "configurations_fitting": len(advice.ranked), "search_wall_s": wall_s,
                           "mlflow_children_s": mlflow_children_s}
    for gpus, r in advice.best_rows().items():
        out[f"best_tokens_per_s_{gpus}gpu"] = r.tokens_per_s
        out[f"best_mfu_{gpus}gpu"] = r.mfu
    return out


def write_outputs(run_dir: Path, advice: Any, spec: AdviseSpec, header: Mapping[str, Any]) -> dict[str, Any]:
    from slackswap.experiment.advise_plot import write_pareto_png

    data = advice_json(advice, spec, header)
    (run_dir / "advice.json").write_text(json.dumps(data, indent=1) + "\n")
    (run_dir / "advice.md").write_text(summary_markdown(advice, spec, header))
    title = f"{spec.model.name} on {header['hardware']} / {header['node']}: tokens/s per GPU vs peak memory"
    write_pareto_png(advice, run_dir / "advise_pareto.png", spec.hardware.device_memory_bytes, title)
    return data
