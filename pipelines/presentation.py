"""How a run reads in the MLflow UI: names, which params go where, descriptions, metrics with units.

Pure functions of the resolved config and the job record, so they are unit-tested without MLflow.
Why each rule (docs/pipeline.md, "Reading runs in the MLflow UI"):

- A child's name starts with the planner and holds only what varies in its sweep
  (`slackswap · gpt2_xl`): at the UI's default column width the planner is what stays visible.
- Constant params are logged once, on the parent; a child logs what varies plus the few filter keys
  (`model`, `hardware`, `planner`, `budget.fraction` / `budget.bytes`), so 24 children do not repeat
  35 identical values each. `tracking.*` is never a param: it is where the run is logged (absolute
  paths of one machine), which the run already knows.
- Units: bytes are also given in GiB (2**30, unit in the name: `budget_gib`), bandwidths in GB/s
  (1e9), ratios also in percent (`throughput_pct`), the one convention of stdout, plots and MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipelines.records import RunRecord, RunStatus

SEPARATOR = " · "
GIB = 2**30
#: Flattened config keys that are never params (where the run is logged: machine-specific paths).
#: Config keys that are not part of the experiment: where the store and the op-time cache live (paths of
#: one machine; a param must stay comparable across machines and clones).
EXCLUDED_PARAM_PREFIXES = ("tracking.", "profile.cache_dir")
#: Group choices every child logs as params so it can be filtered on its own.
FILTER_GROUPS = ("model", "hardware", "planner")
PERFETTO_HINT = (
    "trace.json: open https://ui.perfetto.dev and drop the file in (or 'Open trace file'); "
    "chrome://tracing opens it too. Tracks compute, d2h, h2d and the memory counter."
)


def size_text(value_bytes: float | None) -> str:
    """Bytes as text in GiB for a full-size model, MiB or KiB for a toy one (`0.000 GiB` says
    nothing): the library's convention (`slackswap.planners.base.gib`), the one of its messages."""
    from slackswap.planners.base import gib

    return "n/a" if value_bytes is None else gib(value_bytes)


def budget_label(budget: Mapping[str, Any]) -> str:
    if budget.get("fraction") is not None:
        return f"{budget['fraction']:g}"
    if budget.get("bytes") is not None:
        return f"{budget['bytes'] / GIB:.3g} GiB"
    return "?"


def _select(resolved: Mapping[str, Any], dotted: str) -> Any:
    node: Any = resolved
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _value_label(key: str, choices: Mapping[str, str], resolved: Mapping[str, Any]) -> str:
    if key in ("budget", "budget.fraction", "budget.bytes"):
        return budget_label(resolved.get("budget") or {})
    if key in choices:
        return str(choices[key])
    value = _select(resolved, key)
    return f"{value:g}" if isinstance(value, float) else str(value)


def planner_first(keys: Sequence[str]) -> list[str]:
    """The same keys, the planner's first (stable otherwise)."""
    return sorted(keys, key=lambda k: not (k == "planner" or k.startswith("planner.")))


def run_name(varying: Sequence[str] | None, choices: Mapping[str, str], resolved: Mapping[str, Any]) -> str:
    """`slackswap · gpt2_xl · 0.5`: planner first, then what varies in the sweep.

    `varying=None` (a single run, no sweep to compare with): planner, model, hardware, budget.
    """
    keys = ["planner", "model", "hardware", "budget"] if varying is None else planner_first(varying)
    labels = [_value_label(k, choices, resolved) for k in keys]
    # Two swept keys of one group (planner and planner.name) may give the same label twice.
    unique = list(dict.fromkeys(labels))
    return SEPARATOR.join(unique) if unique else _value_label("planner", choices, resolved)


def sweep_keys(task_overrides: Sequence[str], sweeper_params: Mapping[str, Any]) -> list[str]:
    """Config keys a multirun sweeps over, in order: the experiment's `hydra.sweeper.params`, then the
    command line, where a plain override of a swept key wins (as in Hydra's basic sweeper)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    texts = [f"{k}={v}" for k, v in sweeper_params.items()] + list(task_overrides)
    swept: dict[str, bool] = {}
    for override in parser.parse_overrides(texts):
        key = override.key_or_group
        if key.startswith("hydra") or key == "experiment":
            continue
        swept[key] = override.is_sweep_override()
    return [k for k, is_sweep in swept.items() if is_sweep]


def config_params(flat: Mapping[str, str]) -> dict[str, str]:
    """The flattened config minus `tracking.*` and the op-time cache's folder."""
    return {k: v for k, v in flat.items() if not k.startswith(EXCLUDED_PARAM_PREFIXES)}


def filter_params(choices: Mapping[str, str], planner_label: str, resolved: Mapping[str, Any]) -> dict[str, str]:
    """The few params a child carries whatever varies, so `params.planner = 'capuchin'` works alone."""
    out = {group: str(choices.get(group, "?")) for group in FILTER_GROUPS}
    out["planner"] = planner_label
    budget = resolved.get("budget") or {}
    for key in ("fraction", "bytes"):
        if budget.get(key) is not None:
            out[f"budget.{key}"] = str(budget[key])
    return out


def swept_value_params(varying: Sequence[str], flat: Mapping[str, str]) -> dict[str, str]:
    """Params of swept leaf keys (`budget.fraction`, `planner.name`); swept groups (`model`) are
    resolved to their differing leaves only at the end of the sweep, see `split_params`."""
    return {k: flat[k] for k in varying if k in flat}


def split_params(per_job: Sequence[Mapping[str, str]]) -> tuple[dict[str, str], set[str]]:
    """(constant params, keys that vary). A key is constant when every job has it with one value."""
    if not per_job:
        return {}, set()
    keys = set().union(*per_job)
    constant: dict[str, str] = {}
    varying: set[str] = set()
    for key in sorted(keys):
        values = {job.get(key) for job in per_job}
        if len(values) == 1 and None not in values:
            constant[key] = per_job[0][key]
        else:
            varying.add(key)
    return constant, varying


def with_units(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics plus `throughput_pct` (0-100) and, for every `*_bytes`, `*_gib`: what the UI shows
    without a calculator. The raw names stay (they are the stage contract)."""
    out = dict(metrics)
    ratio = metrics.get("throughput_ratio")
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        out["throughput_pct"] = 100.0 * ratio
    for key, value in metrics.items():
        if key.endswith("_bytes") and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key.removesuffix("_bytes") + "_gib"] = value / GIB
    return out


def units_note(metrics: Mapping[str, Any]) -> str:
    """The units of the metrics this run logs, from `slackswap.metrics_table` (MLflow shows a metric's
    name and value, never its unit): one line per unit, naming the metrics in it. Text and null metrics
    are not logged, so not listed; booleans are logged as 0 / 1."""
    from slackswap.metrics_table import units_by_unit

    logged = [k for k, v in metrics.items() if v is not None and not isinstance(v, str)]
    lines = [f"- {unit}: {', '.join(f'`{n}`' for n in names)}" for unit, names in units_by_unit(logged).items()]
    if not lines:
        return ""
    return (
        "Metric units (their meanings: docs/contract.md; `*_gib` are the `*_bytes` in GiB, `throughput_pct` "
        "is `throughput_ratio` in percent, booleans are 0 / 1):\n\n" + "\n".join(lines) + "\n"
    )


def _pct(value: Any) -> str:
    return f"{100 * value:.2f} %" if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def child_description(record: RunRecord, resolved: Mapping[str, Any]) -> str:
    """Markdown for `mlflow.note.content`: the outcome first, then what ran and where to look."""
    m = record.metrics
    status = record.status
    what = (
        f"**{record.planner}** on {record.model} / {record.hardware}, "
        f"budget {size_text(m.get('budget_bytes'))} (fraction {resolved['budget'].get('fraction')}) "
        f"of the keep-all peak {size_text(m.get('keep_all_peak_bytes'))}."
    )
    reason = record.failure_reason
    if status == RunStatus.OK:
        verdict = "**OK**" if m.get("fits_device") is not False else (
            f"**OK for the budget, but DOES NOT FIT THE DEVICE** (peak + static + reserve "
            f"{size_text(-(m.get('headroom_bytes') or 0))} over {size_text(m.get('device_memory_bytes'))}; "
            "metric `fits_device` = 0)"
        )
        rate = m.get("tokens_per_s")
        speed = "" if rate is None else f", {rate:,.0f} tokens/s, MFU {_pct(m.get('mfu'))}"
        head = (
            f"{verdict}: throughput {_pct(m.get('throughput_ratio'))} of ideal, step {m.get('step_s', math.nan):.4f} s "
            f"(ideal {m.get('ideal_step_s', math.nan):.4f} s){speed}, "
            f"peak {size_text(m.get('peak_activation_bytes'))}; "
            f"{m.get('swapped_tensors')} tensors swapped, {m.get('recomputed_tensors')} recomputed."
        )
    elif status == RunStatus.INFEASIBLE:
        known = [
            f"budget {size_text(m.get('budget_bytes'))}",
            f"keep-all peak {size_text(m.get('keep_all_peak_bytes'))}",
        ]
        if m.get("min_feasible_bytes") is not None:
            known.append(f"smallest feasible budget {size_text(m['min_feasible_bytes'])}")
        head = (
            "**Infeasible budget** (a result, not a crash: the run finished). "
            f"Reason: {reason}\n\nKnown: {', '.join(known)}."
        )
    elif status == RunStatus.KILLED:
        head = f"**Killed** before it finished. {reason}".rstrip()
    else:
        head = f"**Failed**: {reason}\n\nThe traceback, if any, is the artifact `traceback.txt`."
    files = (
        "Artifacts: `timeline.png` (compute, d2h, h2d streams and memory against the budget), `plan.json`, "
        f"`metrics.json`, `config.resolved.yaml`. {PERFETTO_HINT}"
    )
    units = units_note(m)
    return f"{head}\n\n{what}\n\n{files}\n" + (f"\n{units}" if units else "")


def _reference_table(experiment: Mapping[str, Any]) -> str:
    reference = experiment.get("paper_reference") or {}
    if not reference:
        return ""
    rows = "\n".join(f"| {model} | {value * 100:.1f} % |" for model, value in reference.items())
    source = experiment.get("paper_source") or ""
    return (
        f"\n\nThe paper's figures (throughput retained, {experiment.get('paper_planner', 'slackswap')}):\n\n"
        f"| model | paper |\n|---|---|\n{rows}\n\nSource: {source}"
    )


#: MLflow's limit on a run tag's value (`mlflow.utils.validation.MAX_TAG_VAL_LENGTH`, MLflow 3.x), which
#: the parent's Description (`mlflow.note.content`) is: longer text is cut there, mid-table.
DESCRIPTION_MAX_CHARS = 8000


def sweep_description(
    experiment: Mapping[str, Any],
    swept: Mapping[str, str],
    parent_link: str | None = None,
    results_md: str = "",
    max_chars: int = DESCRIPTION_MAX_CHARS,
    results_file: str = "paper_table.md",
) -> str:
    """Markdown for the parent run and the experiment: what was swept, the paper's figures, results.

    Never over `max_chars`: MLflow cut a long Description (`hardware`, `budget_curves`) mid-table. The
    results table is shown whole when it fits; otherwise the text says how long it is and links the
    artifact that holds it, and a swept list too long to show is ended after whole lines."""
    title = experiment.get("description") or f"Sweep {experiment.get('name', '')}".strip()
    lines = [f"**{title}**", "", "Swept (one child run per combination):", ""]
    lines += [f"- `{key}`: {value}" for key, value in swept.items()] or ["- nothing (single combination)"]
    lines.append("")
    lines.append(
        f"Compare planners: the parent's `planner_comparison.png` and `{results_file}`, or the Chart view "
        "with the `throughput_pct` bar chart (one bar per child, named planner first; an infeasible run "
        "has `feasible` = 0 and no throughput)."
    )
    text = "\n".join(lines) + _reference_table(experiment)
    if parent_link:
        text += f"\n\nResults: [{results_file} and summary.md of the latest sweep]({parent_link})"
    if results_md:
        table = "\n\n" + results_md
        if len(text) + len(table) + 1 > max_chars:
            where = f"[the parent's artifacts]({parent_link})" if parent_link else "the parent's artifacts"
            table = (f"\n\nThe results table ({len(results_md.splitlines())} lines, {len(results_md):,} characters) "
                     f"is longer than MLflow's {max_chars:,}-character Description: it is in {where} "
                     f"(`summary.md`, `{results_file}`), whole.")
        text += table
    if len(text) + 1 > max_chars:  # a swept list of very many keys: whole lines, then how many are left out
        tail = "\n\n... (cut after whole lines at MLflow's limit; the parent's params list every swept key)"
        kept = text[: max_chars - len(tail) - 1].rsplit("\n", 1)[0]
        text = kept + tail
    return text + "\n"
